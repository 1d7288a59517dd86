// The peers of benchmarks/redis_bench.cpp, on the same Redis server
// ($DIBS_REDIS_URL), for benchmarks/run_redis_benchmarks.sh:
//
//   node bench.js --modules DIR --bench lock --procs P --items M [--retry-delay MS]
//       redlock 4.2.0 (npm's latest) on ioredis, one Redis instance: M
//       lock + unlock of one resource in all, shared by P processes.
//       Retries: unlimited (retryCount -1; its default of 10 would make
//       contended processes fail), every --retry-delay ms with as much
//       jitter (its defaults: 200 and 200)
//   node bench.js --modules DIR --bench drain --procs P --items M --concurrency C
//       BullMQ: M no-op jobs added beforehand (addBulk, not timed), then P
//       processes each with one Worker of concurrency C (its docs' example
//       is 50); the time from the start signal to the last job completed
//
// Processes: P children forked from this one; each connects and says
// "ready", and the clock starts when all have (as redis_bench's gate).
// Prints one JSON object, as redis_bench does.
'use strict';
const path = require('path');
const { fork } = require('child_process');

function args() {
  const a = { bench: 'lock', procs: 1, items: 1000, concurrency: 50, retryDelay: 200, modules: '', child: -1, name: '' };
  const v = process.argv.slice(2);
  for (let i = 0; i + 1 < v.length; i += 2) {
    const k = v[i], x = v[i + 1];
    if (k === '--bench') a.bench = x;
    else if (k === '--procs') a.procs = Number(x);
    else if (k === '--items') a.items = Number(x);
    else if (k === '--concurrency') a.concurrency = Number(x);
    else if (k === '--retry-delay') a.retryDelay = Number(x);
    else if (k === '--modules') a.modules = x;
    else if (k === '--child') a.child = Number(x);
    else if (k === '--name') a.name = x;
    else throw new Error(`unknown option ${k}`);
  }
  if (!a.modules) throw new Error('--modules DIR (the node_modules that npm ci made) is needed');
  return a;
}

// redis://USER:PASSWORD@HOST:PORT, as scripts/redis.sh writes it.
function connection() {
  const u = new URL(process.env.DIBS_REDIS_URL || '');
  if (u.protocol !== 'redis:') throw new Error('set DIBS_REDIS_URL (eval "$(scripts/redis.sh env DIR)")');
  return {
    host: u.hostname, port: Number(u.port || 6379), username: decodeURIComponent(u.username) || undefined,
    password: decodeURIComponent(u.password) || undefined, maxRetriesPerRequest: null,
  };
}

const now = () => process.hrtime.bigint();  // CLOCK_MONOTONIC: comparable across the processes

// A child: sets up, says ready, waits for "go", works, says what it did.
async function child(a) {
  const need = (m) => require(path.join(a.modules, m));
  const send = (m) => new Promise((res) => process.send(m, res));
  const mine = Math.floor(((a.child + 1) * a.items) / a.procs) - Math.floor((a.child * a.items) / a.procs);
  const go = new Promise((res) => process.once('message', res));
  if (a.bench === 'lock') {
    const Redis = need('ioredis');
    const Redlock = need('redlock');
    const client = new Redis(connection());
    await client.ping();
    const redlock = new Redlock([client], { retryCount: -1, retryDelay: a.retryDelay, retryJitter: a.retryDelay });
    await send({ ready: true });
    await go;
    for (let i = 0; i < mine; i++) {
      const lock = await redlock.lock(`${a.name}:lock`, 10000);
      await lock.unlock();
    }
    await send({ done: mine, end: now().toString() });
    client.disconnect();
  } else {
    const { Worker } = need('bullmq');
    let done = 0, last = 0n;
    const worker = new Worker(a.name, async () => {}, { connection: connection(), concurrency: a.concurrency, autorun: false });
    worker.on('completed', () => { done++; last = now(); });
    worker.on('failed', (job, e) => { console.error(`bench.js: job ${job && job.id} failed: ${e}`); process.exit(1); });
    await worker.waitUntilReady();
    await send({ ready: true });
    await go;
    worker.run();
    // Says how far it is whenever the queue runs dry for it, and every
    // 100 ms; the parent stops the workers once all jobs are counted.
    const tell = () => send({ done, end: last.toString() });
    worker.on('drained', tell);
    const timer = setInterval(tell, 100);
    await new Promise((res) => process.once('message', res));
    clearInterval(timer);
    await worker.close();
  }
  process.exit(0);
}

async function parent(a) {
  const name = `bench-${a.bench}-node-${process.pid}`;
  if (a.bench === 'drain') {
    const { Queue } = require(path.join(a.modules, 'bullmq'));
    const q = new Queue(name, { connection: connection() });
    for (let k = 0; k < a.items; k += 1000) {
      const jobs = [];
      for (let i = k; i < Math.min(a.items, k + 1000); i++) jobs.push({ name: 'job', data: { i } });
      await q.addBulk(jobs);
    }
    await q.close();
  } else if (a.bench !== 'lock') {
    throw new Error(`unknown bench ${a.bench}`);
  }
  const kids = [], ready = [], said = new Array(a.procs).fill(null);
  for (let p = 0; p < a.procs; p++) {
    const c = fork(__filename, [...process.argv.slice(2), '--child', String(p), '--name', name]);
    kids.push(c);
    ready.push(new Promise((res, rej) => {
      c.once('message', res);
      c.once('exit', (code) => rej(new Error(`bench.js: worker ${p} exited (${code}) before it was ready`)));
    }));
  }
  await Promise.all(ready);
  let finish;
  const all = new Promise((res) => { finish = res; });
  kids.forEach((c, p) => {
    c.removeAllListeners('exit');
    c.on('exit', (code) => { if (code !== 0) { console.error(`bench.js: worker ${p} exited (${code})`); process.exit(1); } });
    c.on('message', (m) => {
      said[p] = m;
      if (said.every((s) => s) && said.reduce((n, s) => n + s.done, 0) === a.items) finish();
    });
  });
  const t0 = now();
  for (const c of kids) c.send({ go: true });
  await all;
  const end = said.reduce((e, s) => (BigInt(s.end) > e ? BigInt(s.end) : e), 0n);
  for (const c of kids) c.send({ stop: true }, () => {});  // a lock worker may have exited already
  const secs = Number(end - t0) / 1e9;
  const way = a.bench === 'lock' ? 'redlock' : 'bullmq';
  const extra = a.bench === 'lock' ? `, "retry_delay_ms": ${a.retryDelay}` : `, "concurrency": ${a.concurrency}`;
  console.log(`{"bench": "${a.bench}", "way": "${way}", "procs": ${a.procs}, "items": ${a.items}, ` +
              `"seconds": ${secs.toFixed(4)}, "items_per_s": ${(a.items / secs).toFixed(0)}${extra}}`);
  await Promise.all(kids.map((c) => new Promise((res) => (c.exitCode !== null ? res() : c.once('exit', res)))));
}

const a = args();
(a.child >= 0 ? child(a) : parent(a)).catch((e) => { console.error(`bench.js: ${e.stack || e}`); process.exit(1); });
