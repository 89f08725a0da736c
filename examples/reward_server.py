"""A small reward-model server for ``rollout.reward_model`` (slime's --rm-url contract): it scores each
posted sample with one of the built-in rewards. Start it from the repository root,

    python -m examples.reward_server --port 8000 --reward toy_copy

and give a job

    rollout:
      reward_model: {url: "http://127.0.0.1:8000/"}

A request's body is one sample, {"prompt", "response", "label", "metadata"}, or a list of them
(reward_model.batch_size above 1); the answer is its reward, or a list of them. With --key the
rewards are dicts ({KEY: reward}), as a reward model that reports more than one number answers: set
reward_model.reward_key to the same key.
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from elastic_rl.rollout.rewards import BUILTIN_REWARDS


def serve(port: int, reward: str, key: str | None, host: str = "127.0.0.1") -> None:
    rule = BUILTIN_REWARDS[reward]

    def score(sample: dict) -> float | dict:
        value = rule(sample["prompt"], sample["response"], sample["label"])
        return {key: value} if key else value

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = [score(sample) for sample in body] if isinstance(body, list) else score(body)
            except (ValueError, KeyError, TypeError) as exc:  # the request's fault: 400, not retried
                self.send_error(400, f"not a sample of the contract: {exc}")
                return
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args) -> None:  # one line per sample would drown the job's logs
            pass

    with ThreadingHTTPServer((host, port), Handler) as server:
        print(f"scoring with {reward} on http://{host}:{server.server_address[1]}/", flush=True)
        server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    parser.add_argument("--reward", choices=sorted(BUILTIN_REWARDS), default="toy_copy")
    parser.add_argument("--key", help="answer {KEY: reward} rather than the bare number")
    args = parser.parse_args()
    serve(args.port, args.reward, args.key, args.host)


if __name__ == "__main__":
    main()
