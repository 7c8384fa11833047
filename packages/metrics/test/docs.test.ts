import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import * as metricsPackage from '../src/index.js';
import { metricCatalog } from './support/catalog.js';

const doc = readFileSync(new URL('../../../docs/metrics.md', import.meta.url), 'utf8');

/** The rows of the markdown tables under a `## heading`, as cells without backticks. */
function tableRows(heading: string): string[][] {
  const section = doc.split(/^## /m).find((part) => part.startsWith(`${heading}\n`));
  if (section === undefined) throw new Error(`docs/metrics.md has no "## ${heading}" section`);
  return section
    .split('\n')
    .filter((line) => line.startsWith('| `'))
    .map((line) =>
      line
        .slice(1, -1)
        .split('|')
        .map((cell) => cell.trim()),
    );
}

const codeNames = (cell: string) => [...cell.matchAll(/`([^`]+)`/g)].map((match) => match[1]);
const catalog = metricCatalog().filter((metric) => metric.name.startsWith('sluice_'));

describe('docs/metrics.md', () => {
  it.each([
    ['Gateway', 'gateway'],
    ['Worker', 'worker'],
  ] as const)('lists every %s metric with its type, labels and buckets', (heading, process) => {
    const rows = tableRows(heading);
    const documented = rows.map(([name = '']) => codeNames(name)[0]);
    const defined = catalog.filter((metric) => metric.process === process);
    expect([...documented].sort()).toEqual(defined.map((metric) => metric.name).sort());

    for (const metric of defined) {
      const [, type = '', labels = '', buckets = '', meaning = ''] = rows.find(([name = '']) => codeNames(name)[0] === metric.name) ?? [];
      expect(type, metric.name).toBe(metric.type);
      expect(codeNames(labels), metric.name).toEqual(metric.labelNames);
      expect(meaning.length, metric.name).toBeGreaterThan(20);
      if (metric.type !== 'histogram') {
        expect(buckets, metric.name).toBe('');
        continue;
      }
      const [constant = ''] = codeNames(buckets);
      const bounds = (metricsPackage as Record<string, unknown>)[constant];
      expect(bounds, `${metric.name}: ${constant} is not exported by @sluice/metrics`).toBeInstanceOf(Array);
      expect(metric.buckets, metric.name).toEqual(bounds);
    }
  });

  it('prints each bucket list as the package defines it', () => {
    const rows = tableRows('Buckets');
    expect(rows.length).toBeGreaterThan(0);
    for (const [name = '', bounds = ''] of rows) {
      const constant = codeNames(name)[0] ?? '';
      const values = bounds.split(',').map((value) => Number(value.trim()));
      expect(values, constant).toEqual((metricsPackage as Record<string, unknown>)[constant]);
    }
  });

  it('uses help text on every metric', () => {
    for (const metric of catalog) expect(metric.help.length, metric.name).toBeGreaterThan(20);
  });
});
