// ESLint flat config: typescript-eslint's type-aware rules over every TypeScript file in the repository
// (sources, tests, benchmarks, the playground). Each file is checked against its nearest tsconfig.json
// (projectService), so tests are linted with the same types they are compiled with.
import js from '@eslint/js';
import globals from 'globals';
import tseslint from 'typescript-eslint';

export default tseslint.config(
  {
    ignores: [
      '**/node_modules/**',
      '**/dist/**',
      'models/**',
      '.turbo/**',
      'coverage/**',
      '.tmp/**',
      '.cache/**',
      'bench-results/**',
      'docs/**',
    ],
  },
  js.configs.recommended,
  ...tseslint.configs.recommendedTypeChecked,
  {
    languageOptions: {
      parserOptions: { projectService: true, tsconfigRootDir: import.meta.dirname },
      globals: { ...globals.node },
    },
    linterOptions: { reportUnusedDisableDirectives: 'error' },
    rules: {
      // The point of the exercise: a promise nobody awaits loses its rejection (an unhandled rejection
      // kills the process) and its ordering. `void` marks the places where ignoring it is the intent.
      '@typescript-eslint/no-floating-promises': 'error',
      '@typescript-eslint/no-misused-promises': 'error',
      // Async stubs and adapters that implement a Promise-returning interface have nothing to await.
      '@typescript-eslint/require-await': 'off',
      // `_`-prefixed names are deliberately unused (positional parameters, destructured leftovers).
      '@typescript-eslint/no-unused-vars': [
        'error',
        {
          argsIgnorePattern: '^_',
          varsIgnorePattern: '^_',
          caughtErrorsIgnorePattern: '^_',
          destructuredArrayIgnorePattern: '^_',
          ignoreRestSiblings: true,
        },
      ],
    },
  },
  {
    files: ['apps/gateway/playground/**/*.ts'],
    languageOptions: { globals: { ...globals.browser } },
  },
  // Tests and benchmarks read replies as untyped JSON (`await res.json()`) and assert on its shape; the
  // assertions, not the types, are the check there.
  {
    files: ['test/**/*.ts', '**/test/**/*.ts', 'bench/**/*.ts', '**/bench/**/*.ts'],
    rules: {
      '@typescript-eslint/no-explicit-any': 'off',
      '@typescript-eslint/no-unsafe-argument': 'off',
      '@typescript-eslint/no-unsafe-assignment': 'off',
      '@typescript-eslint/no-unsafe-call': 'off',
      '@typescript-eslint/no-unsafe-member-access': 'off',
      '@typescript-eslint/no-unsafe-return': 'off',
    },
  },
  // Config files and plain-JS scripts belong to no tsconfig: lint them without types.
  {
    files: ['**/*.js', '**/*.mjs', '**/*.cjs', 'vitest.config.ts'],
    ...tseslint.configs.disableTypeChecked,
  },
);
