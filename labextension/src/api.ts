// The hvd_notebook server extension's REST API (its contract: GET hvd-notebook/clusters,
// POST hvd-notebook/clusters/<id>/<action>), and the small formatting helpers both views share.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export type ClusterState =
  | 'starting'
  | 'idle'
  | 'running'
  | 'stalled'
  | 'breakpoint'
  | 'resetting';

export type ClusterAction = 'interrupt' | 'restart' | 'stop' | 'stacks';

export interface IRankGpu {
  index: number;
  util: number | null;
  memory_used: number | null;
  memory_total: number | null;
  process_memory: number | null;
}

export interface IRank {
  rank: number;
  pid: number | null;
  host: string;
  device: string;
  alive: boolean;
  cpu_percent: number | null;
  rss: number | null;
  gpu: IRankGpu | null;
}

export interface ICluster {
  id: string;
  kind: 'notebook' | 'script';
  notebook: string | null;
  kernel_id: string | null;
  command: string | null;
  framework: string | null;
  backend: string | null;
  hosts: string[];
  n: number;
  state: ClusterState;
  since: number;
  detail: string;
  lease_ends: number | null;
  idle_release_at: number | null;
  actions: ClusterAction[];
  ranks: IRank[];
}

export interface INodeGpu {
  index: number;
  name: string;
  util: number | null;
  memory_used: number | null;
  memory_total: number | null;
  holder: string | null;
  mine: boolean;
}

export interface ICaps {
  max_gpus_per_user: number | null;
  max_ranks_per_user: number | null;
  my_gpus: number;
  my_cpu_ranks: number;
}

export interface IOtherLease {
  user: string;
  gpus: string[];
  ranks: number;
  since: number;
}

/** A start waiting in the node's queue for GPUs, in the order the node serves them. */
export interface IQueueEntry {
  place: number;
  user: string;
  gpus: number;
  since: number;
  mine: boolean;
}

/** One of this user's suspended clusters: no process, its state on disk until resumed or deleted. */
export interface ISuspended {
  id: string;
  ranks: number | null;
  gpus: string[];
  bytes: number;
  since: number | null;
  why: string;
  kernel: number | null;
  error: string | null;
}

export interface IClustersReply {
  time: number;
  user: string;
  clusters: ICluster[];
  gpus: INodeGpu[] | null;
  caps: ICaps | null;
  others: IOtherLease[];
  queue?: IQueueEntry[];
  suspended?: ISuspended[];
}

export interface IActionReply {
  ok: boolean;
  text: string;
}

/** An error whose message is meant for the user as it is (the server's `message`, or what failed). */
export class HvdApiError extends Error {
  constructor(
    message: string,
    readonly status: number | null = null
  ) {
    super(message);
  }
}

const API = 'hvd-notebook';

async function request<T>(
  path: string,
  init: RequestInit,
  timeoutMs: number
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, API, path);
  const abort = new AbortController();
  const timer = window.setTimeout(() => abort.abort(), timeoutMs);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(
      url,
      { ...init, signal: abort.signal },
      settings
    );
  } catch (error) {
    if (abort.signal.aborted) {
      throw new HvdApiError(`no answer within ${Math.round(timeoutMs / 1000)} s`);
    }
    throw new HvdApiError(
      error instanceof Error ? error.message : String(error)
    );
  } finally {
    window.clearTimeout(timer);
  }
  const text = await response.text();
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const message =
      data && typeof data.message === 'string' && data.message
        ? data.message
        : `${response.status} ${response.statusText || 'error'}`.trim();
    throw new HvdApiError(message, response.status);
  }
  if (data === null) {
    throw new HvdApiError(`${response.status}: the answer is not JSON`);
  }
  return data as T;
}

/** GET hvd-notebook/clusters */
export function fetchClusters(): Promise<IClustersReply> {
  return request<IClustersReply>('clusters', { method: 'GET' }, 15000);
}

/** POST hvd-notebook/clusters/<id>/<action>: stop and restart may take tens of seconds. */
export function postAction(
  id: string,
  action: ClusterAction
): Promise<IActionReply> {
  return request<IActionReply>(
    `clusters/${encodeURIComponent(id)}/${action}`,
    { method: 'POST', body: '' },
    180000
  );
}

/** POST hvd-notebook/clusters/<id>/delete: a suspended cluster's saved state thrown away. */
export function deleteSuspended(id: string): Promise<IActionReply> {
  return request<IActionReply>(
    `clusters/${encodeURIComponent(id)}/delete`,
    { method: 'POST', body: '' },
    60000
  );
}

// ---- formatting ----

function pad2(n: number): string {
  return n < 10 ? `0${n}` : `${n}`;
}

/** Seconds as m:ss, or h:mm:ss from an hour on ("0:42", "12:05", "1:23:00"). */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = s % 60;
  return h > 0 ? `${h}:${pad2(m)}:${pad2(sec)}` : `${m}:${pad2(sec)}`;
}

/** Bytes in binary units: "512 MiB", "1.2 GiB"; "—" for null. */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes === null || bytes === undefined || !isFinite(bytes)) {
    return '—';
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit++;
  }
  const digits = unit >= 3 && value < 100 ? 1 : 0;
  return `${value.toFixed(digits)} ${units[unit]}`;
}

/** A percentage as "97 %"; "—" for null. */
export function formatPercent(value: number | null | undefined): string {
  if (value === null || value === undefined || !isFinite(value)) {
    return '—';
  }
  return `${Math.round(value)} %`;
}

/** A server-clock time (seconds since 1970) as the browser's local clock time, "10:02" (with the date when not today). */
export function formatClock(seconds: number): string {
  const date = new Date(seconds * 1000);
  const hm = `${pad2(date.getHours())}:${pad2(date.getMinutes())}`;
  const today = new Date();
  if (date.toDateString() === today.toDateString()) {
    return hm;
  }
  return `${date.toLocaleDateString(undefined, { month: 'short', day: 'numeric' })} ${hm}`;
}

/** [0, 1, 2, 3, 5] as "0-3,5". */
export function compactRanges(indices: number[]): string {
  const sorted = Array.from(new Set(indices)).sort((a, b) => a - b);
  const parts: string[] = [];
  let i = 0;
  while (i < sorted.length) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) {
      j++;
    }
    parts.push(
      j === i
        ? `${sorted[i]}`
        : j === i + 1
          ? `${sorted[i]},${sorted[j]}`
          : `${sorted[i]}-${sorted[j]}`
    );
    i = j + 1;
  }
  return parts.join(',');
}

/** A cluster's devices in short: "CPU", or "GPU 0-3". */
export function devicesSummary(cluster: ICluster): string {
  const indices: number[] = [];
  for (const rank of cluster.ranks) {
    const match = /^GPU\s*(\d+)/i.exec(rank.device || '');
    if (match) {
      indices.push(parseInt(match[1], 10));
    } else if (rank.gpu) {
      indices.push(rank.gpu.index);
    }
  }
  return indices.length ? `GPU ${compactRanges(indices)}` : 'CPU';
}

/** The state in words, long form for the panel. */
export function stateWords(cluster: ICluster): string {
  switch (cluster.state) {
    case 'running':
      return cluster.kind === 'script' ? 'running' : 'running a cell';
    case 'breakpoint':
      return 'at a breakpoint';
    default:
      return cluster.state;
  }
}

/** The state in one word, for the status bar. */
export function stateShort(state: ClusterState | string): string {
  return state === 'breakpoint' ? 'at a breakpoint' : state;
}

/** The last part of a path: "dir/train.ipynb" -> "train.ipynb". */
export function baseName(path: string): string {
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

/** A job's command line, short: each path in it by its last part (`python train.py --epochs 3`). */
export function shortCommand(command: string): string {
  return command
    .split(' ')
    .map(word => (word.includes('/') && !word.endsWith('/') ? baseName(word) : word))
    .join(' ');
}

export function plural(n: number, one: string, many?: string): string {
  return `${n} ${n === 1 ? one : many ?? one + 's'}`;
}
