"""How many tokens each row drafts per step: adaptive speculation, from what the run measures.

A step costs about ``O + V(n) + D(w)``: the loop's own time O, a target forward over n tokens
``V(n) = v0 + v1 n`` (n = running rows + drafts verified) and drafting w tokens ``D(w) = d w``.
A row asking for k drafts gains, besides the one token every step gives,
``G(k) = f a (1 + c_2 + c_2 c_3 + ... + c_2 ... c_k)`` accepted tokens in expectation: a is the
row's rate of accepting its first draft, c_j the rate of accepting draft j once draft j - 1 was
(pooled over rows: drafts come in runs, a copied span right to its end or wrong from its first
token, which one rate per token would miss), f the share of the tokens the row asks for that it
gets (prompt lookup rows without a match get none). Each step the policy picks the lengths
``k_b <= K`` that maximize expected tokens per second
``sum_b (1 + G_b(k_b)) / (O + V(b + sum_b f_b k_b) + D(max_b k_b))`` by Dinkelbach's method: at
a trial rate R each row maximizes ``G_b(k) - R v1 f_b k`` under a common cap w, and the best
cap's rate is the next R. Each cap also weighs every row at its whole length up to the cap, as
priced by the seconds measured per token count: a forward's cost is not a line in its tokens
(at batch 1 on a CPU the first draft costs little, the next few as much as a matrix product
instead of a matrix-vector one, and more hardly more). All rows at 0 is a plain decoding step,
chosen whenever no draft pays for its verification.

Every estimate is forgotten exponentially, step by step (acceptance slowly, `DECAY`; times
fast, `COST_DECAY`, so that a slow start or a change of load soon stops counting), so it
follows the text as it changes; a row whose drafts kept failing also drifts back to the prior
and is probed again with one draft token, where the prior pays for it, after enough plain steps
that the probes cost little; a row's first draft still being verified counts as a miss when the
next step is planned (a failed probe is not repeated on the same evidence). The prior of the
rates c_j is 1/2; that of a row's first-draft rate a is the rate pooled over every row's
verified first drafts (the row's own among them: at batch 1 its own long-run rate), forgotten
slowly (`PRIOR_DECAY`), worth `PRIOR_WEIGHT` of the row's own samples, and carried across calls
with the drafter (1/2 before any evidence): what this drafter was accepted at on this target,
so that a call does not start by probing a draft that earlier calls found useless (a prefix of
the target's layers, accepted under 1% of the time), nor a row of a batch keep probing it.
Before costs are measured, steps draft one token per row until a drafting step has been
timed, then decode plainly until a second token count has been timed. The first step's verify and
step times stand in until the second's replace them (it may pay one-time costs; a step that ran a
CUDA-graph shape eagerly or recorded it is not timed at all). The verify costs (the line, the
seconds per token count, the loop's overhead) belong to the target and the way it runs, not to
the text: a call starts from those an earlier call run alike measured on the same target object
(`known_costs`); its own first step is then not timed, and the carried costs fade under its own
(`COST_DECAY`; a token count's mean as that count is measured again). The drafting costs belong
to the drafter and carry likewise, on the drafter object as the call was given it, as does the
prior above; a drafter object without them (a new one, as a call making its own prompt lookup
is given) starts from those the last drafter of its class measured on the target (carried with
the verify costs), and its forced probe's wait (below) starts over: it has not been shown
useless. A call with drafting costs chooses from its first step (a cheap deterministic drafter
shadows from it), where one without times a drafting step first. A
step far slower than predicted is dropped as an outlier, but not a third in a row: a lasting
change (or carried costs gone stale) is learned. Acceptance is carried only as that prior:
the rest of it belongs to the text. A drafter that has proposed nothing in the first steps
leaves no drafting to price: the policy then starts without, and its shares f keep asking rare.

A proposal made after steps without one can cost more: a drafter in a cache of its own (a
model, a head) reads every token committed since it last proposed. That is paid once when
drafting resumes, not per token drafted, so where such a proposal comes out dearer per token
than the drafting cost measured on proposals made right after another, it is left out (priced
per token it would keep the drafter off after every plain spell, a forced probe included);
before any such steady proposal is timed it stands in, and steps draft one token per row
until one is.

Costs that price drafting out are re-measured only by drafting: a drafting cost or a verify
width timed while the machine was loaded would keep a good drafter off for good (a row's
acceptance drifts back to the prior, which the inflated costs still price out). So after
`PROBE_AFTER` timed steps in a row without a draft verified (counted across calls, with the
carried verify costs), the next step that would decode plainly verifies one draft per row
instead (as far as each row's offer and budget allow), and what it measures replaces the
drafting cost and the verify time at its token count measured before. Each such forced probe
doubles the wait for the next (one whose rows were offered nothing counts too), and a draft the
policy chooses itself resets it, so a drafter that really does not pay costs one forced probe
in `PROBE_AFTER` steps, then in twice that, and so on.

Deterministic chains (no draft logits, no tree: prompt lookup, n-gram drafters) are scored
against the text instead of by their verification: each proposal's tokens are compared with
the tokens the rows go on to commit, verified or not. Verification accepts such a draft exactly
when the committed token equals it (greedy or sampled), so the comparison is the acceptance the
proposal would have had at every length, also on plain steps, from the first step on. Their
first-draft rate a is kept by the state the row was in when the proposal was made (its latest
compared proposal's first draft accepted or not, pooled over rows): hits come in runs, a copied
span going on, so a row just past a hit drafts more often and longer than one just past a miss.
The rates c_j are pooled over both states (once a first draft is accepted the span goes on
alike, and a few dozen steps hold too few proposals to split them). When such a drafter is also
cheap (a proposal costs at most `SHADOW_SHARE` of a step) the loop asks it for K tokens every
step, plain steps included ("shadow" proposals), and chooses each row's length after seeing
what it was offered: rows without a proposal cost nothing, and acceptance is measured without
paying for verification, where probing would.

The estimates live on the host: what they need (accepted counts, draft counts, phase times,
the committed tokens and the proposals scored) arrives in the loop's one transfer per step, so
choosing adds no synchronization.
"""

from __future__ import annotations

import copy
import time
import weakref

from .cuda_graphs import GraphedForward

DECAY = 0.98  # acceptance, per step: what was seen ~35 steps ago weighs half
# The prior a row's first-draft rate starts from and drifts back to, pooled over rows and calls,
# per step: what was seen ~700 steps ago weighs half. Worth PRIOR_WEIGHT samples of the row's own.
PRIOR_DECAY, PRIOR_WEIGHT = 0.999, 2.0
COST_DECAY = 0.95  # times, per step: ~20 steps averaged (outliers are dropped, the first step replaced)
# Timed steps a drafter may answer with nothing before the policy starts without drafting costs
# (a text's first n-grams often match nothing yet: asking a few steps more is cheap).
UNANSWERED_STEPS = 8
# A deterministic drafter proposes K tokens every step when one proposal costs at most this share
# of a step: the price of measuring its acceptance on plain steps.
SHADOW_SHARE = 0.02

LINE_WEIGHT = 2.0  # samples' worth of the fitted line in each token count's mean verify time
# Timed steps in a row without a draft verified before one is forced (module docstring): at most
# about one drafting step's cost in this many steps, less as the wait doubles.
PROBE_AFTER = 64


# Costs per object (a target's verify costs, a drafter's drafting costs), then per way of
# running (`known_costs`: the loop's key).
_KNOWN_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def known_costs(owner, key: tuple) -> dict:
    """The costs adaptive speculation measured on ``owner`` (a target: its verify costs; a
    drafter: its drafting costs) at ``key`` (batch size and way of running, as
    `speculative_generate` builds it) in earlier calls of this process, as a dict that
    `DraftLengths` reads at its start and keeps current (empty before any, or where ``owner``
    cannot be weakly referenced or hashed: nothing is then carried). Dropped with the owner."""
    try:
        return _KNOWN_COSTS.setdefault(owner, {}).setdefault(key, {})
    except TypeError:
        return {}


class _DecayedLine:
    """Least-squares line ``y = intercept + slope x`` over exponentially forgotten samples; the
    slope is never negative (time cannot fall with work)."""

    def __init__(self) -> None:
        self.w = self.x = self.xx = self.y = self.xy = 0.0
        self.slope: float | None = None

    def add(self, x: float, y: float) -> None:
        d = COST_DECAY
        self.w, self.x, self.xx = d * self.w + 1, d * self.x + x, d * self.xx + x * x
        self.y, self.xy = d * self.y + y, d * self.xy + x * y

    def spread(self) -> bool:
        """Whether the samples' x differ (a slope can be fitted)."""
        return self.xx - self.x ** 2 / self.w > 1e-9 * self.w

    def coefficients(self) -> tuple[float, float | None]:
        """(intercept, slope); while the samples' x do not differ, the slope last fitted (None
        before any), the line through their mean."""
        mean_x, mean_y = self.x / self.w, self.y / self.w
        if self.spread():
            self.slope = max(0.0, (self.xy - self.w * mean_x * mean_y) / (self.xx - self.w * mean_x ** 2))
        slope = self.slope
        return mean_y - (slope or 0.0) * mean_x, slope


class DraftLengths:
    """Per-row draft lengths for `speculative_generate`: K for every row (``adaptive=False``) or
    chosen each step from measured acceptance and costs (see the module docstring).

    Rows are input rows (``0 .. batch_size - 1``); the loop passes the ones still running. Each
    step the loop calls `plan` (how many tokens to ask the drafter for), then, at its transfer,
    `observe` (the last verification's outcome, the phase times, the tokens committed and the
    proposal, where `scores` it), `choose` (each row's length, given what it was offered) and
    `verifying` (what it verifies). ``known``: the verify costs of earlier calls run alike
    (`known_costs`), read at the start and kept current; None or empty: measured from scratch.
    ``known_drafting``: the same for the drafting costs and the acceptance prior (of earlier
    calls with the same drafter; empty: those in ``known`` of its class stand in).
    The arithmetic is plain Python on a few numbers per row:
    host work, no tensor to synchronize. ``counts[row][k]`` counts the verified steps the row
    was given length k.
    """

    def __init__(self, max_tokens: int, max_new_tokens: int, batch_size: int, adaptive: bool,
                 known: dict | None = None, known_drafting: dict | None = None) -> None:
        self.K, self.max_new_tokens, self.adaptive = max_tokens, max_new_tokens, adaptive
        self.planned: dict[int, int] = {}  # the lengths planned for the proposal being made
        self.chosen: dict[int, int] = {}  # the lengths being verified
        self.width = 0  # tokens per row asked of the drafter for the proposal being made
        # Whether the drafter was asked for the proposal before it too: then the proposal being made
        # reads one step's committed tokens, not every token since it last proposed (module docstring).
        self.steady = False
        self.steady_drafting = False  # whether the drafting costs come from such proposals
        self.after_offer = False  # the lengths are chosen once the proposal is seen (shadowing; scored start-up)
        # (row, tokens planned, drafted, forecast accepted) per row verified, and tokens verified
        self.verified: tuple[list[tuple[int, int, int, float | None]], int] | None = None
        self.clock = time.perf_counter()
        self.slow_calls = GraphedForward.slow_calls  # graphed forwards that did not replay, so far
        # Forgotten sums per row: steps with a first draft, first drafts accepted, tokens asked
        # for and tokens proposed; pooled over rows, per draft position j >= 2: drafts reached
        # (their predecessor accepted) and accepted.
        self.first_drafts, self.first_accepted = [0.0] * batch_size, [0.0] * batch_size
        # The same pooled over rows and forgotten slowly (`PRIOR_DECAY`): the prior's evidence,
        # carried with the drafting costs.
        self.pooled = [0.0, 0.0]  # first drafts verified, accepted
        self.asked, self.got = [0.0] * batch_size, [0.0] * batch_size
        self.reached, self.passed = [0.0] * (max_tokens + 1), [0.0] * (max_tokens + 1)
        # Deterministic chains are scored against the text (module docstring): per row, the
        # proposals still being compared, as [token ids, how many matched so far, state when made].
        self.deterministic = False  # the drafter's proposals are deterministic chains
        self.trees = False  # the drafter's last proposal was a token tree (`_within_budget`)
        self.keep: dict[int, int] = {}  # per row: the drafts its budget can keep at this verification
        self.pending: list[list[list]] = [[] for _ in range(batch_size)]
        # First-draft acceptance of scored proposals by the state their row was in when proposed:
        # 1 where the row's latest compared proposal had its first draft accepted (a copied span
        # goes on), else 0; forgotten sums pooled over rows, as above.
        self.state = [0] * batch_size
        self.state_first, self.state_accepted = [0.0, 0.0], [0.0, 0.0]
        self.shadowing = False  # asking K tokens every step (a cheap deterministic drafter)
        self.proposal_seconds = self.proposals = 0.0  # forgotten sums: seconds per proposal
        self.step_seconds = self.steps = 0.0  # forgotten sums: seconds per step
        # Forgotten sums of the drafts accepted and of what the estimates above forecast for
        # them: their ratio corrects the forecasts (priors and lagging estimates run optimistic).
        self.realized = self.forecast = 0.0
        self.forecasts: dict[int, list[float]] = {}  # per row: forecast accepted drafts for k = 0 .. K
        self.expected: dict[int, float] = {}  # per row: the forecast for the length verified
        self.counts = [[0] * (max_tokens + 1) for _ in range(batch_size)]
        self.verify = _DecayedLine()  # seconds of target forward + sampling vs tokens verified
        # The same per token count: forward times are not linear in the tokens (matmul forms
        # change with the row count), so counts seen are predicted from their own times.
        self.verify_at: dict[int, tuple[float, float]] = {}  # forgotten sums: seconds, samples
        self.draft_seconds = self.draft_tokens = 0.0  # forgotten sums: D(w) = d w
        self.overhead = None  # seconds per step outside verification and drafting
        self.steps_seen = 0  # steps timed
        self.dropped = 0  # timed steps dropped in a row as outliers
        self.timed_drafts = False  # whether a verification with drafts was timed
        # Verify costs measured by earlier calls (`known_costs`), kept current in ``known``.
        self.known, self.carried = known, bool(adaptive and known and "verify" in known)
        # Timed steps since a draft was verified, and how many a forced probe waits for (carried
        # with the verify costs: a lock-out outlives the call that timed it).
        self.stale = [0, PROBE_AFTER]
        self.forcing = self.forced = False  # a forced probe planned; the verification being made is one
        if self.carried:
            self.verify, self.verify_at = copy.copy(known["verify"]), dict(known["verify_at"])
            self.overhead, self.stale = known["overhead"], list(known.get("stale", self.stale))
            self.step_seconds, self.steps = known.get("step", (0.0, 0.0))
            # Whether drafters of this class made deterministic chains: a cheap one shadows from
            # the first step, as on every later one.
            self.deterministic = known.get("deterministic", False)
        # Drafting costs and the prior measured by earlier calls with this drafter, kept current
        # likewise; else those of the last drafter of its class on this target (module docstring).
        self.known_drafting, own = known_drafting, (known_drafting or {}).get("drafting") is not None
        stand_in = known_drafting if own else known if self.carried else {}
        if adaptive and stand_in.get("drafting"):
            self.draft_seconds, self.draft_tokens, self.proposal_seconds, self.proposals = stand_in["drafting"]
            self.pooled = list(stand_in.get("pooled", self.pooled))
            self.shadowing, self.steady_drafting = self._shadows(), True
        if self.carried and not own:
            self.stale[1] = PROBE_AFTER

    def plan(self, rows: list[int], generated: dict[int, int]) -> int:
        """How many tokens per row to ask the drafter for next (0: no proposal, the next step
        decodes plainly), for the batch's ``rows``. ``generated``: each row's tokens as of the
        last transfer (absent: 0); the step before this proposal's verification adds at least
        one, so more than ``max_new_tokens - generated - 2`` drafts could not all be kept within
        the row's budget, and are not asked for (a tree's nodes are, while one draft can be:
        `_within_budget`). Shadowing (module docstring), K."""
        self.forecasts, self.steady = {}, self.width > 0
        if not self.adaptive:
            lengths = [self.K] * len(rows)
        elif not self._ready():
            # One-token drafts until a drafting step is timed (the first step's times are
            # replaced by the second's; a step planned while a drafting step is in flight
            # waits for its outcome), and until a proposal made right after another is.
            waiting = self.steady_drafting and (self.timed_drafts or (self.steps_seen > 0
                                                                      and any(self._in_flight().values())))
            lengths = [0 if waiting else 1] * len(rows)
        elif self.shadowing:  # chosen once the proposal is seen
            lengths = [self.K] * len(rows)
        else:
            lengths = self._forced_probe(self._best(rows))
        self.planned = {row: self._within_budget(k, self.max_new_tokens - generated.get(row, 0) - 2)
                        for row, k in zip(rows, lengths, strict=True)}
        # Whether `choose` picks the lengths once the offer is seen (where every cost is measured
        # by then): fixed here, as the plan was made (the measurements between may flip
        # `shadowing`). A deterministic drafter is asked for K until then too: its proposals
        # are scored from the start.
        self.after_offer = self.adaptive and (self.shadowing or (self.deterministic and not self._ready()))
        self.width = max(self.planned.values(), default=0)
        if self.after_offer:
            room = max((self.max_new_tokens - generated.get(row, 0) - 2 for row in rows), default=0)
            self.width = self._within_budget(self.K, room)
        return self.width

    def scores(self, deterministic_chain: bool) -> bool:
        """Whether the loop's transfer should read the tokens committed and the proposal's ids
        for scoring (module docstring). ``deterministic_chain``: the proposal just made (if any:
        else the last seen) had no draft logits and no tree."""
        if self.width:
            self.deterministic = self.adaptive and deterministic_chain
        return self.deterministic

    def choose(self, rows: list[int], offered: list[int], generated: list[int]) -> list[int]:
        """Each row's draft length for the next verification (0 .. ``offered``, what the drafter
        proposed for it), for the batch's ``rows`` still running: the planned lengths, or, where
        the plan asked for K to see the offer (shadowing, or a scored drafter before its costs
        are known) and every cost is measured by now, the best lengths given the offers.
        ``generated``: each row's tokens so far. Every chain leaves out the drafts past
        ``max_new_tokens - generated - 1`` (the verification adds one more token): the plan cut
        its lengths by counts one verification old, which may since have gained up to K + 1
        tokens, and a row given more drafts than its budget keeps would commit tokens past it,
        past the room the caches hold (`Drafter.prefill`'s ``max_len``). A tree keeps its nodes
        (`_within_budget`)."""
        best = self.after_offer and self._ready()
        if best:
            lengths = self._forced_probe(self._best(rows, offered), offered)
        else:
            lengths = [self.planned.get(row, 0) for row in rows]
        # The drafts each row's budget can keep: a tree's path stops there (`_within_budget`).
        self.keep = {row: max(0, self.max_new_tokens - g - 1) for row, g in zip(rows, generated, strict=True)}
        lengths = [self._within_budget(k, self.keep[row]) for row, k in zip(rows, lengths, strict=True)]
        if not best:  # what the row asked for, as far as its budget goes: a budget cut is no shortfall of the drafter's
            self.planned.update(zip(rows, lengths, strict=True))
        # (A plan's forecasts already weigh what the drafter offers (the share f): taken before the offer's cut.)
        self.expected = {row: self.forecasts[row][min(k, self.keep[row])] for row, k in zip(rows, lengths, strict=True)
                         if row in self.forecasts}
        lengths = [min(k, o) for k, o in zip(lengths, offered, strict=True)]
        self.chosen = dict(zip(rows, lengths, strict=True))
        return lengths

    def _forced_probe(self, lengths: list[int], offered: list[int] | None = None) -> list[int]:
        """``lengths``, or one draft per row (as far as ``offered``) where they are all 0 and the
        costs have gone unmeasured for the steps a forced probe waits (module docstring); not
        while a drafting verification's outcome is unseen (a plan, ``offered`` None), nor before a
        step of the call is timed (the call's first may be left out, and the probe with it)."""
        in_flight = any(self._in_flight().values()) and offered is None
        if any(lengths) or in_flight or self.steps_seen < 1 or self.stale[0] < self.stale[1]:
            return lengths
        self.forcing = True
        return [1 if offered is None else min(1, o) for o in offered or lengths]

    def _within_budget(self, k: int, room: int) -> int:
        """A row's length ``k`` where at most ``room`` of its drafts can be kept. A chain keeps
        its first ``room``. A tree keeps every node while one draft can be: a path, not the node
        count, is what the budget bounds, and the loop stops each accepted path at the row's
        budget (a tree cut to its first ``room`` nodes would keep fewer and shallower paths)."""
        if self.trees:
            return k if room > 0 else 0
        return max(0, min(k, room))

    def verifying(self, rows: list[int], drafted: dict[int, int], tokens: int) -> None:
        """The loop verifies ``drafted[row]`` drafts of each of ``rows`` (``tokens`` in all)."""
        # Acceptance is scored on the drafts a row could keep: a tree's nodes past its budget's
        # depth were verified (and cost their tokens) but could never be accepted.
        keep = lambda row, k: min(k, self.keep.get(row, k))
        self.verified = ([(row, keep(row, self.planned.get(row, 0)), keep(row, drafted[row]), self.expected.get(row))
                          for row in rows],
                         tokens)
        for row in rows:
            self.counts[row][self.chosen[row]] += 1
        if self.forcing and tokens == len(rows):  # a forced probe whose rows were offered nothing: waits anew
            self.stale = [0, 2 * self.stale[1]]
        self.forced, self.forcing = self.forcing and tokens > len(rows), False

    def observe(self, rows: list[int], accepted: list[int], verify_s: float, draft_s: float,
                committed: list[list[int]] | None = None, proposals: list[list[int]] | None = None) -> None:
        """At the loop's transfer, for the batch's ``rows``: the drafts each had ``accepted`` at
        the last verification, the seconds of that verification (target forward and sampling)
        and of the proposal made since; where the loop `scores`, each row's ``committed`` tokens
        since the last transfer (-1: none) and the ``proposals`` just made (each row's offered
        tokens; None or empty without one). Where the verification or the proposal ran a shape
        eagerly or recorded its CUDA graph (`GraphedForward`), the seconds are one-time work,
        not costs, and are left out."""
        slow_calls, self.slow_calls = self.slow_calls, GraphedForward.slow_calls
        now = time.perf_counter()
        step_s, self.clock = now - self.clock, now
        if committed is not None:
            self._compare(rows, committed, proposals or [[] for _ in rows])
        if self.verified is None:
            return
        (verified, tokens), width = self.verified, self.width
        if self.after_offer and not self.shadowing:  # asked K to score it, priced as the planned width
            width = max(self.planned.values(), default=0)
        self.verified = None
        accepted = dict(zip(rows, accepted, strict=True))
        rows, asked, got, forecast = (list(column) for column in zip(*verified, strict=True))
        self._measured(rows, asked, got, [accepted[r] for r in rows], tokens, verify_s, width,
                       draft_s if width else 0.0, step_s, forecast, timed=slow_calls == self.slow_calls,
                       steady=self.steady)

    def _compare(self, rows: list[int], committed: list[list[int]], proposals: list[list[int]]) -> None:
        """Score the pending proposals against each row's newly ``committed`` tokens (first
        drafts and draft j given j - 1, as a verification would have), then add the
        ``proposals`` just made. A proposal leaves at its first mismatch or its end (a row that
        finishes keeps its last few: they are never compared again)."""
        for row, tokens, ids in zip(rows, committed, proposals, strict=True):
            tokens = [t for t in tokens if t >= 0]
            still = []
            for entry in self.pending[row] if tokens else ():
                draft, matched, state = entry
                for t in tokens:
                    hit = t == draft[matched]
                    if matched == 0:
                        self.first_drafts[row] += 1
                        self.first_accepted[row] += hit
                        self.state_first[state] += 1
                        self.state_accepted[state] += hit
                        self.state[row] = int(hit)
                    else:
                        self.reached[matched + 1] += 1
                        self.passed[matched + 1] += hit
                    matched += 1
                    if not hit or matched == len(draft):
                        break
                else:
                    still.append([draft, matched, state])
            self.pending[row] = still + ([[ids, 0, self.state[row]]] if ids else [])

    def _shadows(self) -> bool:
        """Whether to ask K tokens every step (module docstring: a cheap deterministic drafter)."""
        return (self.deterministic and self.proposals > 0 and self.steps > 0
                and self.proposal_seconds / self.proposals <= SHADOW_SHARE * self.step_seconds / self.steps)

    def _in_flight(self) -> dict[int, int]:
        """Per row, the drafts of the verification made and not yet observed (the loop plans
        the next step before the last one's outcome arrives)."""
        return {} if self.verified is None else {row: drafted for row, _, drafted, _ in self.verified[0]}

    def _ready(self) -> bool:
        """Whether every cost has been measured: a second verify width too, unless the drafter
        has proposed nothing in `UNANSWERED_STEPS` timed steps (then there is no drafting to
        price: the shares f say so, and the policy asks again as they recover)."""
        measured = len(self.verify_at) > 1 or (self.steps_seen >= UNANSWERED_STEPS and not any(self.got))
        return measured and self.draft_tokens > 0 and self.steady_drafting and self.overhead is not None

    def _predicted(self, tokens: float, width: int, curve: tuple | None = None) -> float:
        """Predicted seconds of a step verifying ``tokens`` after drafting ``width`` per row (when
        shadowing, a proposal of K whatever is verified); ``curve``: `_verify_curve`, if made."""
        drafting = (self.proposal_seconds / self.proposals if self.shadowing
                    else self.draft_seconds / self.draft_tokens * width)
        return self.overhead + self._verify_seconds(tokens, curve) + drafting

    def _verify_curve(self) -> tuple[float, float, list[int], dict[int, float]]:
        """What `_verify_seconds` reads: the line (v0, v1), the token counts measured and their
        means, each drawn toward the line by `LINE_WEIGHT` samples (one step's time swings by
        more than a few drafts cost, so a count seen once or twice says little on its own).
        Made once per choice of lengths, which prices many candidates."""
        v0, v1 = self._verify_line()
        mean = {n: (seconds + LINE_WEIGHT * (v0 + v1 * n)) / (weight + LINE_WEIGHT)
                for n, (seconds, weight) in self.verify_at.items()}
        return v0, v1, sorted(mean), mean

    def _verify_seconds(self, tokens: float, curve: tuple | None = None) -> float:
        """Seconds to verify ``tokens`` (a fractional count: the expected one): interpolated
        between the nearest token counts measured, extrapolated past them along the two nearest
        (the slope within 0 and the line's cap); the line while one count is measured
        (`_verify_curve`, or ``curve`` as it made)."""
        v0, v1, counts, mean = curve or self._verify_curve()
        if len(counts) < 2:
            return v0 + v1 * tokens
        if tokens <= counts[0] or tokens >= counts[-1]:
            n0, n1 = counts[:2] if tokens <= counts[0] else counts[-2:]
            slope = min(max((mean[n1] - mean[n0]) / (n1 - n0), 0.0), v1)
            base = n0 if tokens <= counts[0] else n1
            return mean[base] + slope * (tokens - base)
        n1 = next(n for n in counts if n >= tokens)
        n0 = max(n for n in counts if n < tokens)
        share = (tokens - n0) / (n1 - n0)
        return (1 - share) * mean[n0] + share * mean[n1]

    def _verify_line(self) -> tuple[float, float]:
        """(v0, v1) of ``V(n) = v0 + v1 n``, the slope capped at the mean seconds per token of the
        measured tokens: a forward over more tokens never costs more per token than over fewer
        (a mis-measured slope, e.g. from a first call at a new shape, is kept within that). Until
        two token counts are measured the slope is that cap: drafting is not assumed cheap;
        while recent samples share one count, the slope last fitted stands."""
        v0, v1 = self.verify.coefficients()
        mean_x = self.verify.x / self.verify.w
        cap = (v0 + (v1 or 0.0) * mean_x) / mean_x
        if v1 is None or v1 > cap:
            return v0 + ((v1 or 0.0) - cap) * mean_x, cap
        return v0, v1

    def _best(self, rows: list[int], offered: list[int] | None = None) -> list[int]:
        """The lengths maximizing expected tokens per second (module docstring); with the
        ``offered`` tokens known (shadowing), row b's length is at most ``offered[b]`` and its
        share f is 1."""
        K, b = self.K, len(rows)
        run = [1.0]  # P(drafts 2 .. j accepted | draft 1 accepted), j = 1 .. K
        for j in range(2, K + 1):
            run.append(run[-1] * (self.passed[j] + 1) / (self.reached[j] + 2))
        # G_b(k) for k = 0 .. K (corrected by the realized share), f_b, and the longest length that gains
        gains, shares, limits = [], [], []
        self.forecasts = {}
        calibration = (self.realized + 2) / (self.forecast + 2)
        in_flight = self._in_flight()
        prior = PRIOR_WEIGHT * (self.pooled[1] + 1) / (self.pooled[0] + 2)  # (1/2 before any evidence)
        for i, r in enumerate(rows):
            # A verification still in flight (planning runs before its outcome is read) counts
            # as a miss: a row probed once is not probed again on the same evidence.
            missed = offered is None and in_flight.get(r, 0) > 0
            a = (self.first_accepted[r] + prior) / (self.first_drafts[r] + missed + PRIOR_WEIGHT)
            if self.deterministic:  # scored: by the row's state (a copied span tends to go on)
                s = self.state[r]
                a = (self.state_accepted[s] + 1) / (self.state_first[s] + 2)
            f = 1.0 if offered is not None else (self.got[r] + 1) / (self.asked[r] + 1)
            limit = K if offered is None else offered[i]  # past it, length buys nothing
            gain = [0.0]
            for j in range(1, K + 1):
                gain.append(gain[-1] + (f * a * run[j - 1] if j <= limit else 0.0))
            self.forecasts[r] = gain
            gains.append([calibration * g for g in gain])
            shares.append(f)
            limits.append(limit)
        curve = self._verify_curve()
        v1 = curve[1]
        rate, best = b / self._predicted(b, 0, curve), [0] * b  # plain decoding
        for _ in range(3):
            # For each cap w, every row's best length k <= w at this rate (ties: the shorter).
            choices = []  # [row][w]
            for gain, f in zip(gains, shares, strict=True):
                top, row_choice = 0, []
                for k in range(K + 1):
                    if gain[k] - rate * v1 * f * k > gain[top] - rate * v1 * f * top:
                        top = k
                    row_choice.append(top)
                choices.append(row_choice)
            # Each cap's choices, and every row at its whole length up to the cap: the row choices
            # price drafts along the line's slope, but a forward's cost can jump at its first
            # draft and hardly grow after (at batch 1 on a CPU, matrix-vector products give way to
            # matrix products), which the measured seconds per count show and the slope cannot.
            improved = None
            for w in range(K + 1):
                for choice in ([c[w] for c in choices], [min(w, limit) for limit in limits]):
                    tokens = b + sum(f * k for f, k in zip(shares, choice, strict=True))
                    expected = b + sum(g[k] for g, k in zip(gains, choice, strict=True))
                    seconds = self._predicted(tokens, max(choice), curve)
                    if expected / seconds > rate * (1 + 1e-9):
                        improved, rate = choice, expected / seconds
            if improved is None:
                break
            best = improved
        return best

    def _measured(self, rows: list[int], asked: list[int], proposed: list[int], accepted: list[int],
                  verify_tokens: int, verify_s: float, draft_tokens: int, draft_s: float, step_s: float,
                  forecast: list[float | None] | None = None, timed: bool = True, steady: bool = True) -> None:
        """One step's measurements: for each of the batch's ``rows`` the drafts it asked for, got
        and had accepted; the target forward and sampling (``verify_s`` seconds over
        ``verify_tokens`` tokens), the next proposal (``draft_s`` seconds for ``draft_tokens``
        per row, 0 if none was made) and the whole step from one transfer to the next (not
        costs where ``timed`` is False). ``steady``: the drafter was asked for a proposal the
        step before this one's too."""
        for sums in (self.first_drafts, self.first_accepted, self.asked, self.got, self.reached, self.passed,
                     self.state_first, self.state_accepted):
            sums[:] = [DECAY * x for x in sums]
        self.realized, self.forecast = DECAY * self.realized, DECAY * self.forecast
        self.pooled = [PRIOR_DECAY * x for x in self.pooled]
        for expected, m in zip(forecast or [], accepted, strict=False):
            if expected is not None:
                self.forecast += expected
                self.realized += m
        for r, k, p, m in zip(rows, asked, proposed, accepted, strict=True):
            if not self.shadowing:  # (shadow proposals are asked for K: the share f is not used)
                self.asked[r] += k
                self.got[r] += p
            if self.deterministic:  # acceptance comes from scoring against the text
                continue
            self.first_drafts[r] += p > 0
            self.first_accepted[r] += m > 0
            self.pooled[0] += p > 0
            self.pooled[1] += m > 0
            for j in range(2, min(p, m + 1) + 1):  # drafts 2 .. p whose predecessor was accepted
                self.reached[j] += 1
                self.passed[j] += m >= j
        # A step that took far longer than its prediction was preempted or met a new shape: it
        # does not tell the costs of the next steps. The first verification may pay one-time
        # costs (allocations, kernel choices): its times only stand in until the second's.
        # (The proposal measured with the first is the second: drafting times are kept.)
        if not timed:
            return
        self.steps_seen += 1
        # (Not a third such step in a row: a lasting change, or carried costs gone stale, is
        # learned, not dropped.)
        if self._ready() and step_s > 3 * self._predicted(verify_tokens, draft_tokens) and self.dropped < 2:
            self.dropped += 1
            return
        self.dropped = 0
        # Costs unmeasured for the steps a forced probe waits: this step's replace them (module docstring).
        stale = self.stale[0] >= self.stale[1]
        # A proposal after steps without one may read every token committed since (a model or a
        # head in its own cache): one dearer per token than the steady cost says nothing of it
        # and is left out; before any steady cost it stands in until one is timed.
        known = self.draft_seconds / self.draft_tokens if self.steady_drafting and self.draft_tokens else None
        if draft_tokens and (steady or known is None or draft_s / draft_tokens <= known):
            if stale or not self.steady_drafting:
                self.draft_seconds = self.draft_tokens = self.proposal_seconds = self.proposals = 0.0
            self.steady_drafting = steady or known is not None
            self.draft_seconds = COST_DECAY * self.draft_seconds + draft_s
            self.draft_tokens = COST_DECAY * self.draft_tokens + draft_tokens
            self.proposal_seconds = COST_DECAY * self.proposal_seconds + draft_s
            self.proposals = COST_DECAY * self.proposals + 1
            if self.known_drafting is not None and self.steady_drafting:  # for the next call with this drafter
                self.known_drafting["drafting"] = (self.draft_seconds, self.draft_tokens, self.proposal_seconds,
                                                   self.proposals)
        self.timed_drafts |= verify_tokens > len(rows)
        if self.carried and self.steps_seen == 1:  # the carried costs stand in for the first step's
            return
        if verify_tokens > len(rows):  # a draft verified: the costs are measured
            if stale:
                self.verify_at.pop(verify_tokens, None)
            self.stale = [0, 2 * self.stale[1] if self.forced else PROBE_AFTER]
        else:
            self.stale[0] += 1
        if self.steps_seen == 2 and not self.carried:  # the first step's times stood in until now (module docstring)
            self.verify, self.verify_at, self.overhead = _DecayedLine(), {}, None
            self.step_seconds, self.steps = 0.0, 0.0
            self.timed_drafts = verify_tokens > len(rows)
        self.step_seconds = COST_DECAY * self.step_seconds + step_s
        self.steps = COST_DECAY * self.steps + 1
        self.shadowing = self._shadows()
        self.verify.add(verify_tokens, verify_s)
        seconds, weight = self.verify_at.get(verify_tokens, (0.0, 0.0))
        self.verify_at[verify_tokens] = (COST_DECAY * seconds + verify_s, COST_DECAY * weight + 1)
        rest = max(0.0, step_s - verify_s - draft_s)
        self.overhead = rest if self.overhead is None else COST_DECAY * self.overhead + (1 - COST_DECAY) * rest
        if self.known is not None and len(self.verify_at) > 1 and (self.carried or self.steps_seen > 2):
            # For the next call (`known_costs`): the live estimates, copied when it starts.
            self.known.update(verify=self.verify, verify_at=self.verify_at, overhead=self.overhead)
        if self.known is not None and "verify" in self.known:  # (for the next call: a lock-out outlives this one)
            self.known.update(stale=list(self.stale), deterministic=self.deterministic,
                              step=(self.step_seconds, self.steps))
            if self.draft_tokens and self.steady_drafting:  # (for a new drafter of this class)
                self.known.update(drafting=(self.draft_seconds, self.draft_tokens, self.proposal_seconds,
                                            self.proposals), pooled=list(self.pooled))
        if self.known_drafting is not None and self.draft_tokens:
            self.known_drafting["pooled"] = list(self.pooled)
