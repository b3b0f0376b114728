# SPDX-License-Identifier: Apache-2.0
"""The Mooncake backend (``VLLM_ASCEND_ROUTING_STORE=mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata``):
Mooncake's distributed store, for trainers on other nodes than their rollout engines.

One Mooncake object per key. Mooncake (0.3.13) reads byte ranges of an object (``get_into_ranges``): a layer's run of
rows costs that many bytes on the wire (measured: 1.00-1.01x the range, 64 KiB to 1 MiB of a 15 MB object), so objects
are not split into blocks. Puts are zero-copy (``batch_put_from_multi_buffers`` over the registered parts); reads land
in one registered staging buffer, then are copied out.

A Mooncake object lives in the segment of the client that put it and goes when that client exits (measured): an
engine core mounts a segment for its byte cap (``segment_bytes``, plus headroom) and keeps it while it lives; a reader
mounts none. Mooncake only *prefers* the putting client's segment: an object it placed in another client's (another
engine's lifetime) is taken back and the put refused (``StoreFullError``). Objects are hard-pinned: the master never
evicts them under memory pressure; they go when released (``remove``), on the ledger's TTL, or with their engine.

Mooncake's Python client answers status integers, never raises; they map to this package's errors in ``_raise``.
"""

from __future__ import annotations

import ctypes
import importlib
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.store import keys
from vllm_ascend_routing.store.interface import StoreError, StoreFullError, StoreUnavailableError, UnknownKeyError

logger = get_logger(__name__)

FORM = (
    "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"
    "[&protocol=tcp|rdma][&device=NAME][&segment_mib=N][&buffer_mib=N]"
)
INSTALL = (
    "install Mooncake's client: pip install mooncake-transfer-engine-non-cuda (CPU hosts; "
    "mooncake-transfer-engine-npu on Ascend, mooncake-transfer-engine-cuda13 on GPU hosts), and the libraries it "
    "links against: libibverbs1, ibverbs-providers, libnl-3-200, libnl-route-3-200 (Debian/Ubuntu names; "
    "libibverbs.so.1, libnl-3.so.200 and libnl-route-3.so.200 on LD_LIBRARY_PATH suffice). "
    "scripts/mooncake_kit.py --print-env provides both without root"
)
_PROTOCOLS = ("tcp", "rdma")
_DEFAULT_BUFFER_MIB = 16
# A segment takes objects up to ~90% of its size (the master's eviction_high_watermark_ratio binds hard-pinned
# objects too) and rounds small ones up (measured: 100 KB objects fill 94% of what is left): a writer's segment gets
# a quarter above its byte cap, so the ledger's cap binds first, not the segment (which would spill: ``put``).
_HEADROOM = 4
_MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller segment ("Total size must be at least 16777216")

# Mooncake's ErrorCode values (mooncake-store types.h); Python sees the integers only.
_NO_AVAILABLE_HANDLE = -200  # no room in any segment
_INVALID_PARAMS = -600  # e.g. a range past the object's end
_REPLICA_IS_NOT_READY = -703
_OBJECT_NOT_FOUND = -704
_LEASE_EXPIRED = -707  # the object's read lease ran out during the transfer: read again
_TRANSFER_FAIL = -800  # the segment holding the object did not answer (its client exited: -704 once the master sees it)
_UNREACHABLE = {-900, -901, -1010, -1011}  # RPC_FAIL, RPC_TIMEOUT, unavailable in the master's current status/mode
_QUOTA_EXCEEDED = -1700


@dataclass(frozen=True)
class MooncakeSettings:
    """A ``mooncake://`` setting, parsed (``parse_url``)."""

    master_host: str
    master_port: int
    metadata_url: str  # Mooncake's HTTP metadata server, e.g. the master's own (-enable_http_metadata_server)
    protocol: str = "tcp"  # the transfer engine's: tcp, or rdma
    device: str = ""  # rdma: the RDMA device(s), e.g. "mlx5_0"
    segment_mib: int | None = None  # a writer's segment, instead of its byte cap (plus headroom)
    buffer_mib: int = _DEFAULT_BUFFER_MIB  # the registered staging buffer reads go through (larger ranges: in steps)

    @property
    def master(self) -> str:
        host = f"[{self.master_host}]" if ":" in self.master_host else self.master_host
        return f"{host}:{self.master_port}"


def _mib(url: str, name: str, text: str, least: int) -> int:
    if not text.isdigit() or int(text) < least:
        raise ValueError(f"{url!r}: {name}={text!r} is not a whole number of MiB of at least {least}; expected {FORM}")
    return int(text)


def parse_url(url: str) -> MooncakeSettings:
    """The settings of ``url``; ``ValueError`` naming the accepted form for anything else."""

    def bad(why: str) -> ValueError:
        return ValueError(f"{url!r} is not a Mooncake store URL ({why}): expected {FORM}")

    if not isinstance(url, str):
        raise bad("not a string")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        host, port = parts.hostname, parts.port
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as error:
        raise bad(str(error)) from None
    if parts.scheme != "mooncake":
        raise bad("the scheme must be mooncake://")
    if not host or port is None or parts.username or parts.password:
        raise bad("the master must be given as MASTER_HOST:PORT")
    if parts.path not in ("", "/") or parts.fragment:
        raise bad("nothing may follow the master's address but ?metadata=...")
    unknown = sorted(set(query) - {"metadata", "protocol", "device", "segment_mib", "buffer_mib"})
    if unknown:
        raise bad(f"unknown parameter {', '.join(unknown)}")
    repeated = sorted(name for name, values in query.items() if len(values) > 1)
    if repeated:
        raise bad(f"{', '.join(repeated)} given more than once")
    given = {name: values[0] for name, values in query.items()}
    metadata = given.get("metadata", "")
    meta = urllib.parse.urlsplit(metadata)
    try:
        meta_port = meta.port
    except ValueError:
        meta_port = None
    if meta.scheme != "http" or not meta.hostname or meta_port is None:
        raise bad("metadata=http://HOST:PORT/metadata is required: the master's HTTP metadata server")
    protocol = given.get("protocol", "tcp").lower()
    if protocol not in _PROTOCOLS:
        raise bad(f"protocol={protocol!r}: expected tcp or rdma")
    segment = given.get("segment_mib")
    return MooncakeSettings(
        master_host=host,
        master_port=port,
        metadata_url=metadata,
        protocol=protocol,
        device=given.get("device", ""),
        segment_mib=None if segment is None else _mib(url, "segment_mib", segment, 1),
        buffer_mib=_mib(url, "buffer_mib", given.get("buffer_mib", str(_DEFAULT_BUFFER_MIB)), 1),
    )


def probe(settings: MooncakeSettings, timeout: float = 3.0) -> None:
    """Whether the master and its metadata server answer: a TCP connect to the master's port and an HTTP GET of the
    metadata URL (any HTTP answer counts, a 404 too). Mounts nothing, writes nothing: for start-up, in every
    process. Raises ``StoreUnavailableError`` saying what to do."""
    _probe_master(settings, timeout)
    # A proxy from the environment must not answer for the metadata server: none is used.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    query = urllib.parse.urlencode({"key": "vllm_ascend_routing/probe"})
    separator = "&" if urllib.parse.urlsplit(settings.metadata_url).query else "?"
    try:
        with opener.open(f"{settings.metadata_url}{separator}{query}", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError) as error:
        raise StoreUnavailableError(
            f"Mooncake's metadata server {settings.metadata_url} (of master {settings.master}) does not answer "
            f"({getattr(error, 'reason', error)}): start the master with -enable_http_metadata_server=true and that "
            "port, or fix metadata= in VLLM_ASCEND_ROUTING_STORE"
        ) from error


def _probe_master(settings: MooncakeSettings, timeout: float) -> None:
    try:
        with socket.create_connection((settings.master_host, settings.master_port), timeout=timeout):
            pass
    except OSError as error:
        raise StoreUnavailableError(
            f"the Mooncake master {settings.master} does not answer ({error}): start it (mooncake_master -port "
            f"{settings.master_port} -enable_http_metadata_server=true -http_metadata_server_port PORT) or fix the "
            "master's address in VLLM_ASCEND_ROUTING_STORE"
        ) from error


def _local_address(settings: MooncakeSettings) -> str:
    """This host's address as the master's other clients reach it: the one the route to the master leaves from
    (Mooncake's peers connect to it; 127.0.0.1 only for a master on this host)."""
    try:
        family = socket.AF_INET6 if ":" in settings.master_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe_socket:
            probe_socket.connect((settings.master_host, settings.master_port))  # UDP: no packet is sent
            return str(probe_socket.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class MooncakeBackend:
    """A Mooncake client. ``segment_bytes`` > 0: a writer (an engine core), mounting a segment that holds its objects
    while it lives (its byte cap: the segment gets headroom above it, or ``segment_mib`` of the URL instead);
    0: a reader, mounting nothing. ``local_hostname``: the address Mooncake's peers reach this process at (default:
    the one the route to the master leaves from). ``timeout_s``: the start-up probe's (connect, metadata GET).

    Mooncake's calls hold the GIL and do not time out quickly against a master that is gone (setup retries for
    minutes, a read or remove for ~4 s, teardown ~20 s): setup runs only after the probe answered, and once a call
    found the master gone every later one probes it first (a TCP connect) and fails at once while it stays away."""

    name = "mooncake"

    def __init__(
        self,
        settings: MooncakeSettings | str,
        segment_bytes: int = 0,
        *,
        local_hostname: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.settings = parse_url(settings) if isinstance(settings, str) else settings
        if segment_bytes < 0:
            raise ValueError(f"segment_bytes={segment_bytes}: expected 0 (a reader) or more")
        try:
            store = importlib.import_module("mooncake.store")
        except ImportError as error:  # the module, or a library it links against (libibverbs, libnl)
            raise StoreUnavailableError(
                f"VLLM_ASCEND_ROUTING_STORE=mooncake:// cannot load Mooncake ({error}): {INSTALL}"
            ) from error
        probe(self.settings, timeout=timeout_s)
        if segment_bytes:
            wanted = segment_bytes + segment_bytes // _HEADROOM
            self.segment_bytes = max(
                self.settings.segment_mib << 20 if self.settings.segment_mib else wanted, _MIN_SEGMENT
            )
        else:
            self.segment_bytes = 0
        self.local_hostname = local_hostname or _local_address(self.settings)
        self._lock = threading.Lock()  # the staging buffer, and registrations of a put's parts
        self._client: Any = store.MooncakeDistributedStore()
        self._closed = False
        self._master_gone = False  # a call found the master gone: probe it before the next
        self._retired: list[np.ndarray] = []  # staging buffers a failed transfer may still write into
        self.bytes_read = 0  # bytes transferred by reads (a ranged read transfers its range only)
        self.reads = 0
        buffer_bytes = self.settings.buffer_mib << 20
        master = self.settings.master
        code = self._client.setup(
            self.local_hostname,
            self.settings.metadata_url,
            self.segment_bytes,
            buffer_bytes,  # Mooncake's own transfer buffer (its plain get/put; sized like ours)
            self.settings.protocol,
            self.settings.device,
            master,
        )
        if code != 0:
            self._closed = True
            raise StoreUnavailableError(
                f"the Mooncake client could not join master {master} (metadata {self.settings.metadata_url}, "
                f"protocol {self.settings.protocol}, {self.segment_bytes >> 20} MiB segment; code {code}): check the "
                "master's log, that the metadata server is the master's (-enable_http_metadata_server=true), that "
                f"this host's {self.local_hostname} is reachable by the master's other clients, and for rdma the device"
            )
        self._staging = self._new_staging(buffer_bytes)
        self._config = store.ReplicateConfig()
        self._config.replica_num = 1
        self._config.with_hard_pin = True  # never evicted: rows go on release, TTL or with their engine only
        if self.segment_bytes:
            self._config.preferred_segment = self._client.get_hostname()  # this engine's segment: its lifetime
        logger.info(
            "Mooncake row store: master %s, %s, segment %d MiB (%s)",
            master,
            self.settings.protocol,
            self.segment_bytes >> 20,
            self._client.get_hostname(),
        )

    # ---- helpers ----

    def _new_staging(self, nbytes: int) -> np.ndarray:
        staging = np.empty(nbytes, dtype=np.uint8)
        code = self._client.register_buffer(staging.ctypes.data, nbytes)
        if code != 0:
            raise StoreUnavailableError(f"Mooncake could not register a {nbytes >> 20} MiB read buffer (code {code})")
        return staging

    def _name(self, key: str) -> str:
        return keys.object_of(key)  # ``@rows`` names the same object; a name is its own

    def _live(self) -> Any:
        if self._closed:
            raise StoreUnavailableError("this Mooncake store client is closed")
        if self._master_gone:
            _probe_master(self.settings, 1.0)
            self._master_gone = False
        return self._client

    def _raise(self, code: int, key: str, what: str) -> None:
        master = self.settings.master
        if code == _OBJECT_NOT_FOUND:
            raise UnknownKeyError(key)
        if code == _TRANSFER_FAIL and what == "put":
            raise StoreUnavailableError(
                f"Mooncake put of {key!r}: the transfer into the segment Mooncake chose failed (code {code})"
            )
        if code == _TRANSFER_FAIL:
            raise UnknownKeyError(key, "the segment holding it does not answer: its engine exited or is unreachable")
        if code == _REPLICA_IS_NOT_READY:
            raise UnknownKeyError(key, "its put has not completed")
        if code in (_NO_AVAILABLE_HANDLE, _QUOTA_EXCEEDED):
            raise StoreFullError(
                f"Mooncake {what} of {key!r}: no room (code {code}; this client's segment {self.segment_bytes >> 20} "
                "MiB): raise segment_mib= or lower VLLM_ASCEND_ROUTING_STORE_MIB"
            )
        if code in _UNREACHABLE:
            self._master_gone = True
            raise StoreUnavailableError(
                f"Mooncake {what} of {key!r}: the master {master} does not answer (code {code}): is mooncake_master "
                "still running and reachable?"
            )
        raise StoreError(f"Mooncake {what} of {key!r} failed with code {code} (master {master})")

    # ---- Backend ----

    def put(self, key: str, parts: list[memoryview]) -> None:
        name = self._name(key)
        arrays = []
        for part in parts:
            array = np.frombuffer(part, dtype=np.uint8)
            # Registration wants writable memory (RDMA registers it for local writes): copy read-only parts (the
            # header); the rows come writable from layout.encode.
            arrays.append(array if array.flags.writeable else array.copy())
        arrays = [array for array in arrays if array.size]
        client = self._live()
        # Mooncake answers success to a put of a key it holds and keeps the old object: a key is written once.
        exists = int(client.is_exist(name))
        if exists == 1:
            raise StoreError(f"Mooncake put of {key!r}: the key is taken (keys are written once)")
        if exists < 0:
            self._raise(exists, key, "put")
        with self._lock:
            registered = []
            try:
                for array in arrays:
                    code = client.register_buffer(array.ctypes.data, array.nbytes)
                    if code != 0:
                        self._raise(code, key, "put (registering its bytes)")
                    registered.append(array)
                code = client.batch_put_from_multi_buffers(
                    [name],
                    [[array.ctypes.data for array in arrays]],
                    [[array.nbytes for array in arrays]],
                    self._config,
                )[0]
            finally:
                for array in registered:
                    client.unregister_buffer(array.ctypes.data)
        if code != 0:
            self._raise(code, key, "put")
        if self.segment_bytes:
            self._check_placement(client, name, key)

    def put_new(self, items: list[tuple[str, bytes]]) -> list[str]:
        """One existence check and one put for all ``items`` (pointers: a few hundred bytes each). A key written by
        another client between the two keeps its object (Mooncake keeps the first) and counts as written here: its
        pointer then goes with this engine's ledger, and its readers compute instead (never other rows). Placement is
        not checked: a pointer lives as long as its ledger keeps it, wherever Mooncake put it."""
        if not items:
            return []
        client = self._live()
        names = [self._name(key) for key, _ in items]
        states = [int(state) for state in client.batch_is_exist(names)]
        for (key, _), state in zip(items, states, strict=True):
            if state < 0:
                self._raise(state, key, "put")
        fresh = [(key, name, data) for (key, data), name, state in zip(items, names, states, strict=True) if not state]
        if not fresh:
            return []
        blob = np.frombuffer(b"".join(data for _, _, data in fresh), dtype=np.uint8).copy()  # writable: registered
        offsets = np.cumsum([0] + [len(data) for _, _, data in fresh])
        with self._lock:
            code = client.register_buffer(blob.ctypes.data, blob.nbytes)
            if code != 0:
                self._raise(code, fresh[0][0], "put (registering its bytes)")
            try:
                codes = client.batch_put_from_multi_buffers(
                    [name for _, name, _ in fresh],
                    [[blob.ctypes.data + int(offsets[i])] for i in range(len(fresh))],
                    [[len(data)] for _, _, data in fresh],
                    self._config,
                )
            finally:
                client.unregister_buffer(blob.ctypes.data)
        return [key for (key, _, _), code in zip(fresh, codes, strict=True) if int(code) == 0]

    def _check_placement(self, client: Any, name: str, key: str) -> None:
        """Mooncake only prefers this client's segment: a put that does not fit there lands in another client's,
        whose lifetime (another engine's) is not this engine's. Such an object is removed and the put refused."""
        own = client.get_hostname()
        where = sorted(
            {
                str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
                for replica in client.get_replica_desc(name)
                if replica.is_memory_replica()
            }
        )
        if where and where != [own]:
            client.remove(name, True)
            raise StoreFullError(
                f"Mooncake put of {key!r}: no room in this engine's segment ({own}, {self.segment_bytes >> 20} MiB; "
                f"Mooncake placed it in {', '.join(where)}): raise segment_mib= or lower VLLM_ASCEND_ROUTING_STORE_MIB"
            )

    def read(self, key: str, offset: int, nbytes: int) -> bytes:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"read of {key!r}: offset {offset} and nbytes {nbytes} must be 0 or more")
        name = self._name(key)
        if nbytes == 0:
            if self.size(key) is None:
                raise UnknownKeyError(key)
            return b""
        client = self._live()
        chunks: list[bytes] = []
        done = 0
        with self._lock:
            step = self._staging.nbytes
            while done < nbytes:
                count = min(step, nbytes - done)
                code = self._get_range(client, name, offset + done, count)
                if code != count:
                    if code >= 0:  # an object shorter than its size said: not one of ours
                        raise StoreError(f"Mooncake read of {key!r}: {code} of {count} bytes at {offset + done}")
                    if code == _INVALID_PARAMS:
                        size = self.size(key)
                        if size is None:
                            raise UnknownKeyError(key)
                        if offset + nbytes > size:
                            raise UnknownKeyError(key, f"its object ends before byte {offset + nbytes}")
                    self._raise(code, key, "read")
                chunks.append(self._staging[:count].tobytes())  # the one copy out of the staging buffer
                done += count
        self.bytes_read += nbytes
        self.reads += 1
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _get_range(self, client: Any, name: str, at: int, count: int) -> int:
        """One ranged transfer into the staging buffer; the bytes read or Mooncake's code."""
        for _ in range(3):
            code = int(
                client.get_into_ranges([self._staging.ctypes.data], [[name]], [[[0]]], [[[at]]], [[[count]]])[0][0][0]
            )
            if code != _LEASE_EXPIRED:
                break
        if code < 0 and code not in (_OBJECT_NOT_FOUND, _INVALID_PARAMS, _REPLICA_IS_NOT_READY):
            # A failed transfer may still land in the buffer later: use a fresh one; the old stays registered
            # (never reused, freed with the client).
            self._retired.append(self._staging)
            self._staging = self._new_staging(self._staging.nbytes)
        return code

    def size(self, key: str) -> int | None:
        code = int(self._live().get_size(self._name(key)))
        if code >= 0:
            return code
        if code in (_OBJECT_NOT_FOUND, _TRANSFER_FAIL):
            return None
        self._raise(code, key, "size")
        return None  # unreachable: _raise raises

    def remove(self, key: str) -> bool:
        # force: an object a reader fetched holds a read lease (10 s by default) that would refuse the removal; the
        # ledger removes only what the trainer released or what expired.
        code = int(self._live().remove(self._name(key), True))
        if code == 0:
            return True
        if code == _OBJECT_NOT_FOUND:
            return False
        self._raise(code, key, "remove")
        return False  # unreachable

    def close(self) -> None:
        """Unmount this client's segment (its objects go) and disconnect. Against a master that is gone, Mooncake's
        teardown would retry for ~20 s (GIL held): the client is then left as it is, never destroyed (its segment
        went with the master)."""
        if self._closed:
            return
        self._closed = True
        try:
            _probe_master(self.settings, 1.0)
        except StoreUnavailableError:
            logger.warning("Mooncake row store: master %s is gone: its client is left open", self.settings.master)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._client))  # its destructor would retry as close does
            return
        for staging in [self._staging, *self._retired]:
            self._client.unregister_buffer(staging.ctypes.data)
        code = int(self._client.close())
        if code != 0:
            logger.warning("Mooncake row store: closing the client returned code %d", code)
