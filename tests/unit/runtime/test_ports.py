"""The rendezvous ports: a requeued Slurm job's port lies outside the ephemeral range that port-0 binds draw from."""

import socket

from megatron_rlvr.runtime.ports import DEFAULT_EPHEMERAL_RANGE, ephemeral_range, free_port, lasting_free_port


def _range_file(tmp_path, text: str):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_a_lasting_port_is_outside_the_ephemeral_range_and_can_be_bound(tmp_path):
    path = _range_file(tmp_path, "32768\t60999\n")
    for _ in range(20):
        port = lasting_free_port(path)
        assert not 32768 <= port <= 60999, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now


def test_the_range_is_read_from_the_kernel_file_and_defaults_where_it_cannot_be(tmp_path):
    assert ephemeral_range(_range_file(tmp_path, "20000 40000")) == (20000, 40000)
    assert ephemeral_range(_range_file(tmp_path, "garbage")) == DEFAULT_EPHEMERAL_RANGE
    assert ephemeral_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE
    port = lasting_free_port(_range_file(tmp_path, "20000 40000"))
    assert port > 40000, port


def test_a_range_that_leaves_no_room_falls_back_to_an_ephemeral_port(tmp_path):
    port = lasting_free_port(_range_file(tmp_path, "1024 65535"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # a port free now, as free_port() finds one
    first, last = ephemeral_range()  # the machine's own range: where free_port() draws from
    assert first <= free_port() <= last
