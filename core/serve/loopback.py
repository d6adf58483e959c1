"""Ray Serve's replica gRPC servers kept on loopback, in every process of the Ray that `nimble
serve` starts (Ray 2.60 has no option for it). Ray is imported when the function runs."""

from __future__ import annotations

from . import ingress


def replica_grpc_on_loopback() -> None:
    """Ray Serve binds each replica's gRPC servers to `[::]`, every interface, with no option (Ray
    2.60, ray/serve/_private: the inter-deployment one in replica.py `_on_initialized`, port 0; the
    direct-ingress one that HAProxy forwards gRPC requests to, in grpc_util.py `start_grpc_server`
    through default_impl.add_grpc_address). On a Ray whose node is 127.0.0.1 (the one `nimble
    serve` starts: `ingress.LOOPBACK_RAY`), this replica binds both to 127.0.0.1 instead, where
    the other replicas and HAProxy reach them. Called in every process of that Ray as it starts
    (a worker setup hook: the fallback proxy's gRPC server too) and in each replica's `__init__`,
    before either server starts; where Ray's code differs, nothing changes (and
    `tests/serve/test_server.py` fails on the listener it sees).

    The direct-ingress server also takes only a port no other process holds
    (`ingress.refuse_taken_port`): Ray asks gRPC for no SO_REUSEPORT with a string where gRPC
    reads an integer, so the option is lost, and every nimble server of a machine numbers its
    replicas' ports alike (from 40000): a second server's replica bound the first one's port, and
    the kernel then split the second server's gRPC requests between both servers' replicas."""
    import ray
    from ray.serve._private import default_impl, replica

    local = ray.util.get_node_ip_address() == "127.0.0.1"
    for module, name in ((replica, "add_port_to_grpc_server"), (default_impl, "add_grpc_address")):
        real = getattr(module, name, None)
        if real is None or getattr(real, "on_loopback", False):
            continue

        def on_loopback(server, address: str, real=real, name=name):
            if local and address.startswith("[::]:"):
                address = "127.0.0.1:" + address[len("[::]:"):]
            if name == "add_grpc_address":
                ingress.refuse_taken_port(address)
            return real(server, address)

        on_loopback.on_loopback = True
        setattr(module, name, on_loopback)
