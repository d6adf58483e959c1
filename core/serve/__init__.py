"""`nimble serve`: artifacts behind the KServe v2 inference protocol, on Ray Serve.

- `protocol`: requests decoded and checked, responses encoded (no Ray, no HTTP server);
- `replica`: one loaded artifact running batches of requests, with its statistics (no Ray);
- `app`: the Ray Serve deployments, the HTTP routes and the command's lifecycle (needs the
  `serve` extra: `pip install 'nimble-gpu[serve]'`).
"""
