"""``kvtier node status``'s text, from a node's STATUS answer: sizes in
binary units, occupancy as a share of capacity, counters as key=value."""

from __future__ import annotations

from kvtier.node.cli import format_status


def test_the_status_text_says_every_field_readably() -> None:
    st = {
        "node": "n1",
        "socket": "/run/kvtier/node.sock",
        "uptime_s": 12.5,
        "host_bytes": 64 << 30,
        "engines": [
            {
                "engine": "vllm-0",
                "pid": 42,
                "uid": 1000,
                "namespace": "ab" * 16,
                "class": 128 << 10,
                "calls": 7,
                "leases": {"scan_pins": 1, "load_pins": 0, "writes": 2},
            }
        ],
        "namespaces": {"ab" * 16: 1, "cd" * 16: 2},
        "region": {
            "pool": "kvnode-n1-region",
            "chunks": 64,
            "chunk_bytes": 1 << 30,
            "free_chunks": 60,
            "reassigned": 3,
        },
        "classes": {
            str(128 << 10): {
                "occupancy": {
                    "blocks": 1000,
                    "capacity": 4000,
                    "chunks": 4,
                    "pinned": 1,
                    "writing": 2,
                    "held": 0,
                },
                "quarantined": 0,
                "stats": {"stores": 9, "lookups": {"hit": 3, "miss": 1}},
                "tiers": {"disk": {"blocks": 5, "io_errors": 0}},
            }
        },
        "counters": {"attached": 1, "refused": 2},
        "writers": 1,
    }
    assert format_status(st).splitlines() == [
        "node n1 at /run/kvtier/node.sock, up 12.5 s, host 64.0 GiB",
        "region kvnode-n1-region: 64 chunks of 1.0 GiB, 60 free, 3 moved between block sizes",
        "engines attached: 1",
        "namespaces: abababababab (1 engine), cdcdcdcdcdcd (2 engines)",
        "  vllm-0: pid 42, uid 1000, namespace abababababab, blocks of 128.0 KiB, 7 calls, "
        "leases scan_pins=1 load_pins=0 writes=2",
        "blocks of 128.0 KiB: 1000 of at most 4000 (25.0%) in 4 chunks; pinned 1, writing 2, "
        "held 0 (0 of engines that died)",
        "  stores=9 lookups.hit=3 lookups.miss=1",
        "  disk: blocks=5 io_errors=0",
        "counters: attached=1 refused=2; engines' worker processes known: 1",
    ]


def test_a_node_without_region_or_engines_prints_what_it_has() -> None:
    st = {
        "node": "n2",
        "socket": "/tmp/s",
        "uptime_s": 0.1,
        "host_bytes": 1000,
        "engines": [],
        "region": None,
        "classes": {},
        "counters": {},
    }
    assert format_status(st).splitlines() == [
        "node n2 at /tmp/s, up 0.1 s, host 1000 B",
        "engines attached: 0",
        "counters: none; engines' worker processes known: 0",
    ]
