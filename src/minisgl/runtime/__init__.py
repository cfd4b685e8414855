"""The daemon: one process tree per model, reached over ZeroMQ; and the tensor-parallel ranks it (or LLM) starts.

protocol.py            typed, versioned msgpack messages and the one codec
daemon.py              the frontend ROUTER, worker start-up (readiness handshake) and shutdown
tokenizer_worker.py    chat templates (tools), tokenization, validation -> typed errors
scheduler_worker.py    the engine loop (TP rank 0; other ranks via minisgl.runtime.tp)
detokenizer_worker.py  incremental UTF-8 safe text, stop strings, tool calls, usage
transport.py           private ipc endpoints, sockets, worker set-up
addresses.py           runtime dir, default ipc address per model, address checks
registry.py            one file per running daemon; file locks
auth.py                CURVE keys of tcp daemons
connection.py          a client's DEALER socket, replies sorted by request id
launcher.py            find / auto-start / stop daemons (client side)
tp.py                  tensor parallelism: rank 0's TPScheduler (each step's ops to every rank), ranks > 0's loop
ranks.py               the ranks' processes: spawn, rendezvous, NCCL/gloo set-up, failure watching
"""
