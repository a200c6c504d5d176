// Drives the published Jetstream client `@skyware/jetstream` (pinned in package.json) against a
// relay's GET /subscribe, for tests/relay/test_jetstream_client.py. Used exactly as its README
// says for Node.js (the `ws` package as the WebSocket implementation).
//
//   node skyware_client.mjs '<options JSON>'
//
// options: {endpoint, cursor?, wantedCollections?, wantedDids?, maxMessageSizeBytes?, watch?}
// stdout, one JSON object per line:
//   {"type": "open"} / {"type": "close"} / {"type": "error", "message"}
//   {"type": "commit"|"identity"|"account", "event": <what the client emitted>}
//   {"type": "create"|"update"|"delete", "event"}   (onCreate/onUpdate/onDelete of `watch`)
//   {"type": "ack", "cmd"}                          (after each stdin command)
// stdin, one JSON command per line:
//   {"cmd": "update", "payload": {...}}  -> jetstream.updateOptions(payload)
//   {"cmd": "stop"}                      -> jetstream.close()
//   {"cmd": "start"}                     -> jetstream.start() (reconnects with the client's cursor)
//   {"cmd": "cursor"}                    -> {"type": "cursor", "cursor": jetstream.cursor}
//   {"cmd": "exit"}
import { createInterface } from "node:readline";
import { Jetstream } from "@skyware/jetstream";
import WebSocket from "ws";

const options = JSON.parse(process.argv[2]);
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

const jetstream = new Jetstream({
	ws: WebSocket,
	endpoint: options.endpoint,
	cursor: options.cursor,
	wantedCollections: options.wantedCollections,
	wantedDids: options.wantedDids,
	maxMessageSizeBytes: options.maxMessageSizeBytes,
});

jetstream.on("open", () => out({ type: "open" }));
jetstream.on("close", () => out({ type: "close" }));
jetstream.on("error", (error) => out({ type: "error", message: String(error?.message ?? error) }));
for (const kind of ["commit", "identity", "account"]) {
	jetstream.on(kind, (event) => out({ type: kind, event }));
}
if (options.watch) {
	jetstream.onCreate(options.watch, (event) => out({ type: "create", event }));
	jetstream.onUpdate(options.watch, (event) => out({ type: "update", event }));
	jetstream.onDelete(options.watch, (event) => out({ type: "delete", event }));
}

createInterface({ input: process.stdin }).on("line", (line) => {
	const msg = JSON.parse(line);
	switch (msg.cmd) {
		case "update":
			jetstream.updateOptions(msg.payload);
			break;
		case "stop":
			jetstream.close();
			break;
		case "start":
			jetstream.start();
			break;
		case "cursor":
			out({ type: "cursor", cursor: jetstream.cursor ?? null });
			break;
		case "exit":
			jetstream.close();
			out({ type: "ack", cmd: msg.cmd });
			process.exit(0);
	}
	out({ type: "ack", cmd: msg.cmd });
});

jetstream.start();
