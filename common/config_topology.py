"""Where each process of a cluster is (``Topology``, a part of ``ClusterConfig``, common/
config.py): how many of each role, each one's advertised and bound address, its inbox
port (``FIXED_PORTS`` for the singletons, then one port per instance), and a prefill
process's place in its pipeline group."""
from __future__ import annotations

from dataclasses import dataclass

from common.config_hosts import INDEXED_ROLES, SINGLE_ROLES

# Ports at fixed offsets from ``base_port``; the per-instance inboxes start at +10.
FIXED_PORTS = {"router": 0, "conductor": 1, "store_master": 2, "conductor_http": 3,
               "store_master_http": 4, "store_events": 5}
FIRST_INSTANCE_PORT = 10


@dataclass(frozen=True)
class PrefillPlace:
    """A prefill process's place: its instance, its stage of ``stages`` (1: a single
    worker), and the process index of its instance's head (stage 0)."""

    instance: int
    stage: int
    stages: int
    head: int


class Topology:
    """ClusterConfig's methods over its counts and addresses (``routers``,
    ``prefill_workers``, ``prefill_stages``, ``prefill_groups``, ``decode_workers``,
    ``colocated_workers``, ``store``, ``host``, ``hosts``, ``bind_host``, ``base_port``)."""

    def processes(self, role: str) -> int:
        """How many processes of ``role`` the cluster has (in either mode)."""
        counts = {"router": self.routers, "conductor": 1, "store_master": 1,
                  "prefill": self.prefill_processes, "decode": self.decode_workers,
                  "store_node": self.store.nodes, "colocated": self.colocated_workers}
        if role not in counts:
            raise ValueError(f"unknown role {role!r}; one of {sorted(counts)}")
        return counts[role]

    def address(self, role: str, index: int = 0) -> str:
        """The advertised address of process ``role``-``index``: where peers reach its
        inbox, HTTP and transfer engine (``[hosts]``, else ``host``)."""
        self.processes(role)  # unknown role: ValueError
        listed = getattr(self.hosts, role)
        if not isinstance(listed, list):  # a singleton's, or every router's
            return listed or self.host
        return listed[index] if 0 <= index < len(listed) else self.host

    def listen_host(self, role: str, index: int = 0) -> str:
        """Where that process binds its listeners: ``bind_host`` or its own address."""
        return self.bind_host or self.address(role, index)

    def port(self, name: str) -> int:
        """A fixed port: one of ``FIXED_PORTS`` (the router's HTTP port is ``http_port``)."""
        if name not in FIXED_PORTS:
            raise ValueError(f"unknown port {name!r}; one of {sorted(FIXED_PORTS)}")
        return self.base_port + FIXED_PORTS[name]

    def inbox(self, role: str, index: int = 0, bind: bool = False) -> str:
        """The inbox address of a process: the fixed ports for the singletons (the first
        router), then one port per prefill worker, decode worker, store node and colocated
        worker in order, then the other routers. ``bind``: the address its owner binds
        (``listen_host``) instead of the advertised."""
        host = self.listen_host(role, index) if bind else self.address(role, index)
        if role in SINGLE_ROLES and index == 0:
            return f"tcp://{host}:{self.port(role)}"
        port = self.base_port + FIRST_INSTANCE_PORT + index
        if role == "router":  # the routers after the first: past every indexed process
            return f"tcp://{host}:{port - 1 + sum(map(self.processes, INDEXED_ROLES))}"
        for earlier in INDEXED_ROLES:
            if earlier == role:
                break
            port += self.processes(earlier)
        return f"tcp://{host}:{port}"

    @property
    def store_events_address(self) -> str:
        """The store master's PUB socket of KV events (the conductor subscribes)."""
        return self.store_events(bind=False)

    def store_events(self, bind: bool) -> str:
        """That PUB socket's address, advertised or (``bind``) bound by the master."""
        host = self.listen_host("store_master") if bind else self.address("store_master")
        return f"tcp://{host}:{self.port('store_events')}"

    @property
    def pipeline_groups(self) -> int:
        """Prefill instances that are pipeline groups (instances 0 .. this - 1)."""
        if self.prefill_stages == 1:
            return 0
        return self.prefill_workers if self.prefill_groups is None else self.prefill_groups

    @property
    def prefill_processes(self) -> int:
        """Prefill processes: ``prefill_stages`` per group, then one per single worker."""
        groups = self.pipeline_groups
        return groups * self.prefill_stages + self.prefill_workers - groups

    def prefill_place(self, index: int) -> "PrefillPlace":
        """Where prefill process ``index`` sits: groups first (index = group * stages +
        stage; stage 0 is the group's head, the one the conductor knows), then singles."""
        grouped = self.pipeline_groups * self.prefill_stages
        if index < grouped:
            group, stage = divmod(index, self.prefill_stages)
            return PrefillPlace(group, stage, self.prefill_stages, index - stage)
        return PrefillPlace(self.pipeline_groups + index - grouped, 0, 1, index)

    def instance_id(self, role: str, index: int) -> str:
        if role == "prefill":
            place = self.prefill_place(index)
            return f"prefill-{place.instance}" + (f".stage{place.stage}" if place.stage else "")
        return f"{role}-{index}"
