"""`nimble serve`: artifacts behind the KServe v2 inference protocol, on Ray Serve.

- `protocol`: requests decoded and checked, responses encoded (no Ray, no HTTP server);
- `replica`: one loaded artifact running batches of requests, with its statistics (no Ray);
- `ingress`: what the server opens on the machine, and the drain's flag (no Ray);
- `reaper`: the process that ends what a server killed outright left (standard library only);
- `app`: the Ray Serve deployments and the HTTP routes; `lifecycle`: the command's start, drain
  and stop (both need the `serve` extra: `pip install 'nimble-gpu[serve]'`).
"""
