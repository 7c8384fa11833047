import { readFile, writeFile } from 'node:fs/promises';

/**
 * Puts `section` between `<!-- marker:begin -->` and `<!-- marker:end -->` in a markdown file,
 * replacing what was there, or appends it with its markers (the file is created when missing).
 */
export async function writeSection(path: string, section: string, marker: string): Promise<void> {
  const begin = `<!-- ${marker}:begin -->`;
  const end = `<!-- ${marker}:end -->`;
  let text = '';
  try {
    text = await readFile(path, 'utf8');
  } catch {
    text = '# Benchmarks\n';
  }
  const block = `${begin}\n${section.trimEnd()}\n${end}`;
  const from = text.indexOf(begin);
  const to = text.indexOf(end);
  const next = from >= 0 && to > from ? text.slice(0, from) + block + text.slice(to + end.length) : `${text.trimEnd()}\n\n${block}\n`;
  await writeFile(path, next);
}
