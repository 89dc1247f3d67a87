import socket

import pytest

from serve_app.runtime import ports
from serve_app.runtime.ports import bindable, ephemeral_port_range, free_port, late_bound_ports


def test_free_ports_lie_between_rays_worker_ports_and_the_ephemeral_range_and_can_be_bound():
    """A port from the ephemeral range can be taken by an outgoing connection before the server
    binds it, one of Ray's worker ports by a worker as it starts."""
    low, high = ephemeral_port_range()
    assert low <= high
    for _ in range(20):
        port = free_port()
        assert port in late_bound_ports() and port >= 20000 and not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("ephemeral", "expected"),
    [
        ((32768, 60999), range(20000, 32768)),  # Linux's default: between Ray's ports and it
        ((15000, 60999), range(61000, 65536)),  # starts below 20000: the ports above it
        ((20500, 65535), range(20000, 65536)),  # leaves no room: every port above Ray's
    ],
)
def test_the_range_fits_the_hosts_ephemeral_range(monkeypatch, ephemeral, expected):
    monkeypatch.setattr(ports, "ephemeral_port_range", lambda: ephemeral)
    assert late_bound_ports() == expected


def test_a_taken_port_is_not_bindable():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        assert not bindable("127.0.0.1", holder.getsockname()[1])
