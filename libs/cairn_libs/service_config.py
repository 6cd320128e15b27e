"""Which cairn RPCs a client may send again after UNAVAILABLE, and the gRPC service
config every cairn channel carries (round_robin over the target's addresses, the
retry policy below).

A retry is safe when sending the call twice has the effect of sending it once:
a read, or a write that is idempotent by a key the request itself carries. Every
RPC of every cairn service is listed here with the reason, in RETRY_SAFE or in
NOT_RETRIED; a test fails when a proto gains an RPC that is in neither, so each
new RPC is decided, not defaulted.

What is retried: only UNAVAILABLE, at most MAX_ATTEMPTS times in all, with
exponential backoff, and only before the server sent anything back (gRPC commits a
call at its first response message; a stream is never replayed after an event).
A replica that is SIGKILLed, restarted or draining makes exactly that failure, so
the call goes to another replica. An UNAVAILABLE the service itself answers (its
database away, a provider down) carries `grpc-retry-pushback-ms: -1` (see
`cairn_libs.server.to_rpc_status`): the replica is alive and its peers share the
dependency, so the caller hears the true reason at once instead of after three
tries. Retry throttling keeps a whole-cluster outage from tripling the load.

Rejected: a client-side retry loop in each caller (every caller would need one,
the REST proxy too, and each would disagree on what is safe); retrying every
status (DEADLINE_EXCEEDED on a write may mean "done"; INTERNAL is a bug to see).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

MAX_ATTEMPTS = 3
INITIAL_BACKOFF = "0.1s"
MAX_BACKOFF = "1s"

RETRY_SAFE: Mapping[str, Mapping[str, str]] = {
    "cairn.gateway.v1.GatewayService": {
        "Chat": "changes nothing in cairn (the run's budget is reserved per attempt and a dead "
        "replica's reservation expires); a retry may pay the vendor once more for one answer, "
        "cheaper than failing the run",
        "ChatStream": "as Chat, and gRPC retries a stream only before its first message",
        "Embed": "a pure function of the texts",
        "ListModels": "a read",
    },
    "cairn.retrieval.v1.RetrievalService": {
        "IngestDocuments": "idempotent by document id: an unchanged document is UNCHANGED the "
        "second time; retried only before the first progress message",
        "DeleteDocument": "idempotent by document id: deleted twice is deleted",
        "Search": "a read",
        "GetDocument": "a read",
        "Stats": "a read",
    },
    "cairn.memory.v1.MemoryService": {
        "Remember": "idempotent by (subject, text): an active memory with the same text is "
        "not written again",
        "UpdateProfile": "idempotent by (subject, key, value): the current value set again "
        "writes no new version",
        "Recall": "a read",
        "Held": "a read",
        "Forget": "idempotent by subject: what is erased stays erased, the second finds nothing",
        "Archive": "idempotent by (conversation, content digest): the held block is returned",
        "RecallBlock": "a read",
        "SearchBlocks": "a read",
    },
    "cairn.orchestrator.v1.OrchestratorService": {
        "StreamRun": "a read of the run's recorded steps; retried only before the first event",
        "GetRun": "a read",
        "ListRuns": "a read",
        "GetTrajectory": "a read",
        "ResolveConfirmation": "idempotent by confirmation token: the write runs exactly once "
        "however often it is approved (I4)",
        "CancelRun": "idempotent in effect by run id: a second cancel changes nothing (a "
        "retry after a lost answer is told the run has ended, CANCELLED)",
        "ListPendingConfirmations": "a read",
        "ListAgents": "a read",
        "ForgetCopies": "idempotent by subject, as Forget",
    },
}

NOT_RETRIED: Mapping[str, Mapping[str, str]] = {
    "cairn.orchestrator.v1.OrchestratorService": {
        "StartRun": "each call starts a new run: sent twice it would run the agent twice",
    },
    "cairn.tools.v1.ToolService": {
        "ListTools": "implemented by a company's system, not by cairn; cairn does not dial it "
        "through this config",
        "InvokeTool": "a company system's tool: its effects are the system's, not cairn's",
    },
}


def service_config() -> dict[str, Any]:
    """The service config (gRFC A2) of every cairn client channel."""
    names = [
        {"service": service, "method": method}
        for service, methods in RETRY_SAFE.items()
        for method in methods
    ]
    return {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": names,
                "retryPolicy": {
                    "maxAttempts": MAX_ATTEMPTS,
                    "initialBackoff": INITIAL_BACKOFF,
                    "maxBackoff": MAX_BACKOFF,
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
        # A retry costs a token, a success gives back a fifth of one; below half the
        # bucket no call is retried, so an outage of every replica is not tripled.
        "retryThrottling": {"maxTokens": 20, "tokenRatio": 0.2},
    }


def service_config_json() -> str:
    return json.dumps(service_config(), separators=(",", ":"))
