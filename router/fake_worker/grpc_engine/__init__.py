"""The fake engine over gRPC (`router fake-worker --protocol grpc`): vLLM's engine service
from the published protos, for routers that tokenize themselves and talk gRPC to their
engines; the same scripted behaviour, prefix cache and `/debug/*` counters as the HTTP
fake, the latter on a side port, and the cache's KV events over `SubscribeKvEvents`.
Needs the `grpc` extra (grpcio, smg-grpc-proto); nothing else in `router` imports it."""
