/**
 * Parses and checks Prometheus text exposition format (version 0.0.4), for tests that read `/metrics`.
 *
 * Sample lines are parsed by `parse-prometheus-text-format` (a port of the Python client's parser).
 * That library folds every series of a labelled histogram into one (its flattening keeps only `le`
 * and drops `_sum`/`_count` that carry labels), so histogram and summary families are handed to it
 * as untyped and their `_bucket`/`_sum`/`_count` series are regrouped here. On top of the parse this
 * module checks what a scraper would reject or a dashboard would misread: bad names, unparsable
 * values, duplicate series, TYPE after samples, non-cumulative buckets, a missing `+Inf` bucket or a
 * `_count` that disagrees with it.
 */
import { createRequire } from 'node:module';

export type PrometheusType = 'counter' | 'gauge' | 'histogram' | 'summary' | 'untyped';

export interface PrometheusSample {
  /** Full series name: the family name, or it plus `_bucket`, `_sum` or `_count`. */
  name: string;
  labels: Record<string, string>;
  value: number;
}

export interface PrometheusHistogram {
  /** Labels of the series, without `le`. */
  labels: Record<string, string>;
  /** Cumulative counts by upper bound, ascending; the last bound is `Infinity`. */
  buckets: Array<{ le: number; count: number }>;
  sum: number;
  count: number;
}

export interface PrometheusFamily {
  name: string;
  help: string;
  type: PrometheusType;
  samples: PrometheusSample[];
  /** One entry per label set, for histogram families; empty otherwise. */
  histograms: PrometheusHistogram[];
}

/** Labels a series must have (a subset match); omitted means every series. */
export type LabelMatch = Record<string, string>;

export class PrometheusMetrics {
  constructor(readonly families: ReadonlyMap<string, PrometheusFamily>) {}

  has(name: string): boolean {
    return this.families.has(name);
  }

  family(name: string): PrometheusFamily {
    const family = this.families.get(name);
    if (family === undefined) throw new Error(`no metric family ${name}`);
    return family;
  }

  /** Sum of the counter, gauge or untyped samples of `name` whose labels include `match`. */
  value(name: string, match: LabelMatch = {}): number {
    const family = this.family(name);
    if (family.type === 'histogram' || family.type === 'summary') {
      throw new Error(`${name} is a ${family.type}: use histogram()`);
    }
    return family.samples.filter((s) => matches(s.labels, match)).reduce((sum, s) => sum + s.value, 0);
  }

  /** The histogram series of `name` whose labels include `match`, added up into one. */
  histogram(name: string, match: LabelMatch = {}): PrometheusHistogram {
    const family = this.family(name);
    if (family.type !== 'histogram') throw new Error(`${name} is a ${family.type}, not a histogram`);
    const series = family.histograms.filter((h) => matches(h.labels, match));
    const first = series[0];
    const buckets = (first?.buckets ?? []).map(({ le }, i) => ({
      le,
      count: series.reduce((sum, h) => sum + (h.buckets[i]?.count ?? 0), 0),
    }));
    return {
      labels: match,
      buckets,
      sum: series.reduce((sum, h) => sum + h.sum, 0),
      count: series.reduce((sum, h) => sum + h.count, 0),
    };
  }
}

/**
 * Fetches `url` (a `/metrics` endpoint), checks that it answers 200 with the Prometheus text format's
 * content type, and parses the body.
 */
export async function scrapePrometheus(url: string): Promise<PrometheusMetrics> {
  const response = await fetch(url);
  const body = await response.text();
  if (response.status !== 200) throw new Error(`GET ${url}: ${response.status} ${body.slice(0, 200)}`);
  const contentType = response.headers.get('content-type') ?? '';
  if (!/^text\/plain(;|$)/.test(contentType) || !/version=0\.0\.4/.test(contentType)) {
    throw new Error(`GET ${url}: content type "${contentType}" is not text/plain; version=0.0.4`);
  }
  return parsePrometheusText(body);
}

/** Parses `text` and checks it; throws an Error naming the first problem found. */
export function parsePrometheusText(text: string): PrometheusMetrics {
  const { declared, sampleLines } = scanLines(text);
  // Histograms and summaries go through the library as untyped; see the module comment.
  const raw = parseTextFormat(text.replace(/^# TYPE (\S+) (histogram|summary)$/gm, '# TYPE $1 untyped'));

  const families = new Map<string, PrometheusFamily>();
  const seriesSeen = new Set<string>();
  for (const rawFamily of raw) {
    const owner = ownerFamily(rawFamily.name, declared);
    let family = families.get(owner);
    if (family === undefined) {
      family = { name: owner, help: '', type: declared.get(owner) ?? 'untyped', samples: [], histograms: [] };
      families.set(owner, family);
    }
    if (rawFamily.name === owner && rawFamily.help !== '') family.help = rawFamily.help;
    for (const { value, labels = {} } of rawFamily.metrics) {
      if (value === undefined) throw new Error(`${rawFamily.name}: sample without a value`);
      checkLabelNames(rawFamily.name, labels);
      const key = `${rawFamily.name}{${labelKey(labels)}}`;
      if (seriesSeen.has(key)) throw new Error(`duplicate series ${key}`);
      seriesSeen.add(key);
      family.samples.push({ name: rawFamily.name, labels, value: parseValue(key, value) });
    }
  }
  // The library merges a sample into the one before it when their labels are equal: a lost line is a
  // duplicate series.
  if (seriesSeen.size !== sampleLines) throw new Error(`${sampleLines - seriesSeen.size} duplicate series`);
  for (const family of families.values()) {
    if (family.type === 'histogram') family.histograms = groupHistograms(family);
    if (family.type === 'counter' && family.samples.some((s) => s.value < 0)) {
      throw new Error(`counter ${family.name} has a negative value`);
    }
  }
  return new PrometheusMetrics(families);
}

// --- the library -------------------------------------------------------------------------------

interface RawFamily {
  name: string;
  help: string;
  type: string;
  metrics: Array<{ value?: string; labels?: Record<string, string> }>;
}

// The package ships CommonJS without type declarations: load it through require and type it here.
const parseTextFormat = createRequire(import.meta.url)('parse-prometheus-text-format') as (text: string) => RawFamily[];

// --- checks ------------------------------------------------------------------------------------

const METRIC_NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*$/;
const TYPES: readonly PrometheusType[] = ['counter', 'gauge', 'histogram', 'summary', 'untyped'];

/**
 * Reads the TYPE lines (checked: valid names, known types, one per family, before its samples) and
 * counts the sample lines.
 */
function scanLines(text: string): { declared: Map<string, PrometheusType>; sampleLines: number } {
  const declared = new Map<string, PrometheusType>();
  const sampled = new Set<string>();
  let sampleLines = 0;
  for (const line of text.split('\n')) {
    const meta = /^# (TYPE|HELP) (\S+)(?: (.*))?$/.exec(line);
    if (meta !== null) {
      const [, keyword, name = '', rest = ''] = meta;
      if (!METRIC_NAME.test(name)) throw new Error(`invalid metric name in "${line}"`);
      if (keyword === 'HELP') continue;
      const type = TYPES.find((t) => t === rest);
      if (type === undefined) throw new Error(`unknown type in "${line}"`);
      if (declared.has(name)) throw new Error(`second TYPE line for ${name}`);
      if (sampled.has(name)) throw new Error(`TYPE line for ${name} after its samples`);
      declared.set(name, type);
    } else if (line.trim() !== '' && !line.startsWith('#')) {
      const name = /^[^\s{]+/.exec(line.trim())?.[0] ?? '';
      if (!METRIC_NAME.test(name)) throw new Error(`invalid metric name in "${line}"`);
      sampled.add(ownerFamily(name, declared));
      sampleLines += 1;
    }
  }
  return { declared, sampleLines };
}

/** The family a series belongs to: `x_bucket`, `x_sum`, `x_count` belong to histogram or summary `x`. */
function ownerFamily(seriesName: string, declared: ReadonlyMap<string, PrometheusType>): string {
  const suffix = /_(bucket|sum|count)$/.exec(seriesName);
  if (suffix === null) return seriesName;
  const base = seriesName.slice(0, suffix.index);
  const type = declared.get(base);
  if (type === 'histogram' || (type === 'summary' && suffix[1] !== 'bucket')) return base;
  return seriesName;
}

/**
 * A sample value as Prometheus reads it (Go's strconv.ParseFloat): a decimal float, or Inf, Infinity
 * and NaN in any case with an optional sign (prom-client writes NaN as "Nan").
 */
function parseValue(name: string, text: string): number {
  if (/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(text)) return Number(text);
  if (/^[-+]?inf(inity)?$/i.test(text)) return text.startsWith('-') ? -Infinity : Infinity;
  if (/^nan$/i.test(text)) return NaN;
  throw new Error(`${name}: invalid value "${text}"`);
}

function checkLabelNames(name: string, labels: Record<string, string>): void {
  for (const label of Object.keys(labels)) {
    if (!LABEL_NAME.test(label) || label.startsWith('__')) {
      throw new Error(`${name}: invalid label name "${label}"`);
    }
  }
}

function groupHistograms(family: PrometheusFamily): PrometheusHistogram[] {
  const byLabels = new Map<string, PrometheusHistogram & { hasSum: boolean; hasCount: boolean }>();
  const entry = (labels: Record<string, string>) => {
    const key = labelKey(labels);
    let histogram = byLabels.get(key);
    if (histogram === undefined) {
      histogram = { labels, buckets: [], sum: 0, count: 0, hasSum: false, hasCount: false };
      byLabels.set(key, histogram);
    }
    return histogram;
  };
  for (const sample of family.samples) {
    const { le, ...labels } = sample.labels;
    if (sample.name === `${family.name}_bucket`) {
      if (le === undefined) throw new Error(`${sample.name} without an le label`);
      entry(labels).buckets.push({ le: parseValue(`${sample.name} le`, le), count: sample.value });
    } else if (sample.name === `${family.name}_sum`) {
      Object.assign(entry(labels), { sum: sample.value, hasSum: true });
    } else if (sample.name === `${family.name}_count`) {
      Object.assign(entry(labels), { count: sample.value, hasCount: true });
    } else {
      throw new Error(`histogram ${family.name} has a sample named ${sample.name}`);
    }
  }
  const histograms: PrometheusHistogram[] = [];
  for (const [key, { hasSum, hasCount, ...histogram }] of byLabels) {
    const where = `${family.name}{${key}}`;
    histogram.buckets.sort((a, b) => a.le - b.le);
    const last = histogram.buckets.at(-1);
    if (last === undefined || last.le !== Infinity) throw new Error(`${where} has no +Inf bucket`);
    if (!hasSum || !hasCount) throw new Error(`${where} lacks _sum or _count`);
    if (last.count !== histogram.count) throw new Error(`${where}: +Inf bucket ${last.count} != _count ${histogram.count}`);
    histogram.buckets.forEach((bucket, i) => {
      const previous = histogram.buckets[i - 1];
      if (previous !== undefined && bucket.count < previous.count) throw new Error(`${where}: buckets are not cumulative`);
    });
    histograms.push(histogram);
  }
  return histograms;
}

function labelKey(labels: Record<string, string>): string {
  return Object.entries(labels)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))
    .map(([name, value]) => `${name}=${JSON.stringify(value)}`)
    .join(',');
}

function matches(labels: Record<string, string>, match: LabelMatch): boolean {
  return Object.entries(match).every(([k, v]) => labels[k] === v);
}
