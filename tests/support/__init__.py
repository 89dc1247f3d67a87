"""What the tests share, kept out of the test modules and the conftest files (which hold fixtures
only): no test module imports another (tests/unit/test_test_layout.py checks it).

* ``inprocess``: the whole app in one process (the real router service and engine deployment
  classes over mock engines, stand-ins for Serve handles) and the helpers of the tests that
  drive it (requests, expected tokens, SSE events, waits).
* ``cluster``: real Ray Serve with real vLLM CPU engines: deploying apps, ports, the idle check,
  metrics, engine handles, Ray's log files.
* ``faults``: fault injection in real engines (imported inside Ray replicas and vLLM's processes).
* ``namespaces``: running a whole story in PID and network namespaces of its own.
* ``two_nodes_driver``: the two-node story, run as a script inside such namespaces.
* ``seeded_engine_driver``: seeded sampling through one in-process vLLM engine, run as a script.
* ``kv_helpers``: stand-ins for the KV connector's unit tests.
* ``fuzz_strategies``: hypothesis strategies for OpenAI request bodies.
* ``log_capture``: a logging handler that keeps its records.
"""
