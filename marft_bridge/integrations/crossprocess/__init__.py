"""Capture across processes: the caller/callee halves of an episode, propagated in request metadata and
joined in the store."""

from __future__ import annotations

from .carrier import (CALLER_KEY, HALF_KEY, CallerRef, trace_id, span_id, inject, extract,
                      conversation_episode_id)
from .propagation import (CallStep, begin_call, CallState, CALLS, join_writer, flush_joins, reply_half,
                          write_reply_half, accept_reply_half, needs_validation, recorded, CalleeHalfStore,
                          callee_recorder)
from .join_writer import (JoinWriter, combine_halves)

__all__ = ['CALLER_KEY', 'CALLS', 'CallState', 'CallStep', 'CalleeHalfStore', 'CallerRef', 'HALF_KEY',
           'JoinWriter', 'accept_reply_half', 'begin_call', 'callee_recorder', 'combine_halves',
           'conversation_episode_id', 'extract', 'flush_joins', 'inject', 'join_writer', 'needs_validation',
           'recorded', 'reply_half', 'span_id', 'trace_id', 'write_reply_half']
