#!/usr/bin/env node
// graphile-worker's side of benchmarks/run_queue_peers.sh: the same two
// measurements as pg_claims's `drain` and `enqueue`, on the same server
// ($DIBS_PG_CONNINFO), each run in a schema of its own that it drops at the
// end. Prints one JSON object, in pg_claims's shape.
//
//   node bench.js --modules DIR --bench drain   --items M
//       M no-op jobs added beforehand (one addJobs call, not timed); one
//       runner with the docs' throughput settings (below) drains them; the
//       time from the first job:start event to the moment the jobs table is
//       seen empty (completions are batched, so the last job:complete event
//       comes before its job is deleted: the table is polled every 2 ms
//       from then on, which is what the time includes)
//   node bench.js --modules DIR --bench enqueue --items M [--batch B]
//       addJobs of M no-op jobs, B per call (default: all in one call, as
//       the docs' figure "jobs queued per second from a single add_jobs
//       batch call" does); the time of the calls alone
//
// DIR: the node_modules that `npm ci` made from this directory's
// package-lock.json (the runner keeps it under the build directory, so
// nothing is installed in the source tree).
"use strict";
const path = require("path");
const { EventEmitter } = require("events");

function usage() {
  console.error("usage: node bench.js --modules DIR --bench <drain|enqueue> --items M [--batch B]");
  process.exit(2);
}

const args = { batch: 0 };
for (let i = 2; i + 1 < process.argv.length; i += 2) {
  const k = process.argv[i].replace(/^--/, "");
  if (!["modules", "bench", "items", "batch"].includes(k)) usage();
  args[k] = process.argv[i + 1];
}
const items = Number(args.items);
if (!args.modules || !["drain", "enqueue"].includes(args.bench) || !(items >= 1)) usage();
const gw = require(path.join(args.modules, "graphile-worker"));
const { Client } = require(path.join(args.modules, "pg"));
const version = require(path.join(args.modules, "graphile-worker", "package.json")).version;

// DIBS_PG_CONNINFO is a libpq keyword string (scripts/pg.sh writes one);
// node-postgres takes a URL.
function connectionString() {
  const c = process.env.DIBS_PG_CONNINFO;
  if (!c) throw new Error("set DIBS_PG_CONNINFO (scripts/pg.sh start DIR writes DIR/conninfo)");
  const kv = Object.fromEntries(c.trim().split(/\s+/).map((p) => p.split(/=(.*)/s).slice(0, 2)));
  const e = encodeURIComponent;
  return `postgres://${e(kv.user)}:${e(kv.password ?? "")}@${kv.host}:${kv.port}/${e(kv.dbname)}`;
}

// Quiet but for warnings and errors: at its default level graphile-worker
// writes a line per runner event, which would time the terminal too.
const logger = new gw.Logger(() => (level, message) => {
  if (level === "error" || level === "warning") console.error(`graphile-worker ${level}: ${message}`);
});

// Its docs' settings for throughput (worker.graphile.org/docs/performance,
// the configuration of their "jobs executed per second" figure): 24 jobs
// at once in one process, a pool of 25 connections, a local queue of 500
// jobs fetched (and locked) in one query, completions batched (a delay of 0
// batches the completions that arrive within one turn of the event loop).
const settings = {
  concurrentJobs: 24,
  maxPoolSize: 25,
  localQueue: { size: 500 },
  completeJobBatchDelay: 0,
  failJobBatchDelay: 0,
};

async function main() {
  const connection = connectionString();
  const schema = `gw_bench_${args.bench}_${process.pid}`;
  const db = new Client({ connectionString: connection });
  await db.connect();
  const utils = await gw.makeWorkerUtils({ connectionString: connection, schema, logger });
  await utils.migrate();
  const specs = Array.from({ length: items }, () => ({ identifier: "noop", payload: {} }));
  const count = async () =>
    Number((await db.query(`SELECT count(*) AS n FROM "${schema}"._private_jobs`)).rows[0].n);
  let seconds;
  let extra = "";
  if (args.bench === "enqueue") {
    const batch = Number(args.batch) > 0 ? Math.min(Number(args.batch), items) : items;
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < items; i += batch) await utils.addJobs(specs.slice(i, i + batch));
    seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    if ((await count()) !== items) throw new Error(`enqueue: ${await count()} jobs in the table, not ${items}`);
    extra = `, "batch": ${batch}`;
  } else {
    await utils.addJobs(specs);
    const events = new EventEmitter();
    let t0 = 0n;
    let completed = 0;
    let failed = 0;
    let allDone;
    const done = new Promise((resolve) => (allDone = resolve));
    events.on("job:start", () => {
      if (t0 === 0n) t0 = process.hrtime.bigint();
    });
    events.on("job:complete", ({ error }) => {
      if (error) ++failed;
      if (++completed === items) allDone();
    });
    const runner = await gw.run({
      connectionString: connection,
      schema,
      logger,
      events,
      noHandleSignals: true,
      taskList: { noop: async () => {} },
      preset: { worker: settings },
    });
    await done;
    while ((await count()) !== 0) await new Promise((r) => setTimeout(r, 2));
    seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    await runner.stop();
    if (failed) throw new Error(`drain: ${failed} jobs failed`);
    extra = `, "concurrent_jobs": ${settings.concurrentJobs}, "local_queue": ${settings.localQueue.size}`;
  }
  await utils.release();
  await db.query(`DROP SCHEMA "${schema}" CASCADE`);
  await db.end();
  console.log(
    `{"bench": "${args.bench}", "way": "graphile", "procs": 1, "items": ${items}, "seconds": ${seconds.toFixed(4)}, ` +
      `"items_per_s": ${Math.round(items / seconds)}${extra}, "version": "${version}"}`,
  );
}

main().catch((e) => {
  console.error(`bench.js: ${e.stack || e}`);
  process.exit(1);
});
