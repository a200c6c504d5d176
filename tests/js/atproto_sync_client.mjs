// Drives the published firehose client `@atproto/sync` (its `Firehose` with the `MemoryRunner`,
// pinned in package.json) against a relay's subscribeRepos, for
// tests/relay/test_atproto_sync_client.py. Used as its README shows: the runner keeps the last seq
// whose handling finished (`setCursor` persists it) and the firehose connects, and reconnects, with
// that cursor; a restart starts a new runner from the persisted cursor. Commits and handles are
// taken unauthenticated (the relay verified them; handle verification would need DNS); DIDs resolve
// against the given PLC directory (the simulator's).
//
//   node atproto_sync_client.mjs '<options JSON>'
//
// options: {service (ws://host:port), plcUrl, cursor?}
// stdout, one JSON object per line:
//   {"type": "event", "seq", "event", "did", "collection"?, "rkey"?}  (each event handled)
//   {"type": "error", "message"}                                       (onError)
//   {"type": "ack", "cmd"}                                             (after each stdin command)
// stdin, one JSON command per line:
//   {"cmd": "stop"}   -> firehose.destroy()
//   {"cmd": "start"}  -> a new runner from the persisted cursor, a new firehose
//   {"cmd": "exit"}
import { createInterface } from "node:readline";
import { IdResolver } from "@atproto/identity";
import { Firehose, MemoryRunner } from "@atproto/sync";

const options = JSON.parse(process.argv[2]);
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");
const idResolver = new IdResolver({ plcUrl: options.plcUrl });
let saved = options.cursor; // the persisted cursor
let firehose;

function start() {
	// concurrency 1: events are handled one at a time, in stream order
	const runner = new MemoryRunner({ startCursor: saved, concurrency: 1, setCursor: (cursor) => { saved = cursor; } });
	firehose = new Firehose({
		idResolver,
		runner,
		service: options.service,
		unauthenticatedCommits: true,
		unauthenticatedHandles: true,
		handleEvent: async (evt) => {
			out({ type: "event", seq: evt.seq, event: evt.event, did: evt.did,
				collection: evt.collection, rkey: evt.rkey });
		},
		onError: (err) => out({ type: "error", message: String(err?.message ?? err) + (err?.cause ? ": " + String(err.cause) : "") }),
	});
	firehose.start();
}

createInterface({ input: process.stdin }).on("line", async (line) => {
	const msg = JSON.parse(line);
	switch (msg.cmd) {
		case "stop":
			await firehose.destroy();
			break;
		case "start":
			start();
			break;
		case "exit":
			out({ type: "ack", cmd: msg.cmd });
			process.exit(0);
	}
	out({ type: "ack", cmd: msg.cmd });
});

start();
