// Drives the published Jetstream client `@atcute/jetstream` (pinned in package.json) against a
// relay's GET /subscribe, for tests/relay/test_jetstream_client.py. Used as its README shows, with
// event validation on (its default: every message is checked against the client's own schema);
// Node 20 has no global WebSocket, so the `ws` package is handed to partysocket.
//
//   node atcute_client.mjs '<options JSON>'
//
// options: {endpoint (the relay's base URL), cursor?, wantedCollections?, wantedDids?}
// stdout, one JSON object per line:
//   {"type": "open"} / {"type": "close"} / {"type": "error", "message"}
//   {"type": "invalid", "message"}                  (a message the client's schema refused: onError)
//   {"type": "commit"|"identity"|"account", "event"} (each event the client yielded)
//   {"type": "ack", "cmd"}                          (after each stdin command)
// stdin, one JSON command per line:
//   {"cmd": "update", "payload": {...}}  -> subscription.updateOptions(payload)
//   {"cmd": "cursor"}                    -> {"type": "cursor", "cursor": subscription.cursor}
//   {"cmd": "exit"}
import { createInterface } from "node:readline";
import { JetstreamSubscription } from "@atcute/jetstream";
import WebSocket from "ws";

const options = JSON.parse(process.argv[2]);
const out = (obj) => process.stdout.write(JSON.stringify(obj) + "\n");

const subscription = new JetstreamSubscription({
	url: options.endpoint,
	cursor: options.cursor,
	wantedCollections: options.wantedCollections,
	wantedDids: options.wantedDids,
	ws: { WebSocket, maxRetries: 0 },
	onConnectionOpen: () => out({ type: "open" }),
	onConnectionClose: () => out({ type: "close" }),
	onConnectionError: (event) => out({ type: "error", message: String(event?.message ?? event?.error ?? event) }),
	onError: (error) => out({ type: "invalid", message: String(error?.message ?? error) }),
});

createInterface({ input: process.stdin }).on("line", (line) => {
	const msg = JSON.parse(line);
	switch (msg.cmd) {
		case "update":
			subscription.updateOptions(msg.payload);
			break;
		case "cursor":
			out({ type: "cursor", cursor: subscription.cursor ?? null });
			break;
		case "exit":
			out({ type: "ack", cmd: msg.cmd });
			process.exit(0);
	}
	out({ type: "ack", cmd: msg.cmd });
});

for await (const event of subscription) {
	out({ type: event.kind, event });
}
