import socket

from serve_app.ports import FIRST_PORT, bindable, ephemeral_port_range, free_port, late_bound_ports


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range_and_can_be_bound():
    """A port from the ephemeral range can be taken by an outgoing connection before the server
    binds it, one of Ray's worker ports by a worker as it starts."""
    low, high = ephemeral_port_range()
    assert FIRST_PORT == 20000 and low <= high
    assert late_bound_ports() == range(20000, max(20001, low))
    for _ in range(20):
        port = free_port()
        assert 20000 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_bindable():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        assert not bindable("127.0.0.1", holder.getsockname()[1])
