package vllmsim

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Admission errors, returned by Scheduler.CheckAdmission. The server answers
// both with 503 and vLLM 0.29's message.
var (
	// ErrQueueOverflow means max-num-queued-reqs unfinished requests exist.
	ErrQueueOverflow = errors.New("request queue is full")
	// ErrQueuedTokens means the prompt tokens still in prefill reached
	// max-num-queued-tokens.
	ErrQueuedTokens = errors.New("prefill token backlog is full")
)

// FinishReason says why a sequence finished.
type FinishReason string

// Finish reasons, as vLLM reports them.
const (
	// FinishStop: the model sampled its end-of-sequence token (or, for a
	// prefill-only sequence, the prefill completed).
	FinishStop FinishReason = "stop"
	// FinishLength: max_tokens or max-model-len was reached.
	FinishLength FinishReason = "length"
	// FinishAbort: the sequence was aborted (client gone).
	FinishAbort FinishReason = "abort"
)

// SequenceStatus is where a sequence is in its life.
type SequenceStatus int

// Sequence statuses.
const (
	// StatusPending: added with an arrival time still in the future.
	StatusPending SequenceStatus = iota
	// StatusWaiting: in the waiting queue, never scheduled or preempted.
	StatusWaiting
	// StatusRunning: in the running set.
	StatusRunning
	// StatusPreempted: back in the waiting queue after a preemption, its
	// computed tokens lost.
	StatusPreempted
	// StatusFinished: done; see FinishReason.
	StatusFinished
)

// String returns the status name.
func (s SequenceStatus) String() string {
	switch s {
	case StatusPending:
		return "pending"
	case StatusWaiting:
		return "waiting"
	case StatusRunning:
		return "running"
	case StatusPreempted:
		return "preempted"
	case StatusFinished:
		return "finished"
	}
	return fmt.Sprintf("SequenceStatus(%d)", int(s))
}

// SequenceSpec describes one sequence for Scheduler.Add: a prompt and the
// output the simulated model will sample for it.
type SequenceSpec struct {
	// ID names the sequence in events and errors.
	ID string
	// Prompt is the tokenized prompt; the scheduler keeps the slice, which
	// must not change afterwards. It must not be empty.
	Prompt []TokenID
	// Arrival is the simulated time the request arrived.
	Arrival time.Duration
	// Priority orders the waiting queue under PolicyPriority; lower first.
	Priority int
	// MaxTokens caps the output. 0 makes a prefill-only sequence (an
	// embedding request) that finishes when its prompt is computed.
	MaxTokens int
	// StopAfter, when positive, makes the model sample its end-of-sequence
	// token as output token number StopAfter (finish reason "stop" unless
	// MaxTokens or MaxModelLen is hit first). 0 never stops early.
	StopAfter int
	// Seed seeds the generated text.
	Seed uint64
	// CacheSalt isolates the sequence's prefix-cache entries: only
	// sequences with the same salt share blocks (vLLM's cache_salt).
	CacheSalt string
}

// Sequence is one request inside the Scheduler. Its accessors may be read
// between steps by the goroutine that drives the scheduler.
type Sequence struct {
	id        string
	prompt    []TokenID
	output    []TokenID
	priority  int
	arrival   time.Duration
	maxTokens int
	stopAfter int
	order     uint64 // admission order, the final tie-breaker
	status    SequenceStatus
	reason    FinishReason

	numComputed int
	scheduled   int // tokens scheduled in the current step
	heapIndex   int

	blocks          []int32
	blockHashes     []uint64
	numCachedBlocks int // leading blocks whose hashes are registered
	hashSeed        uint64

	gen             generator
	numCachedTokens int // prefix-cache hit at first scheduling; -1 before
	numPreemptions  int

	scheduledOnce  bool
	firstScheduled time.Duration
	hasFirstToken  bool
	firstToken     time.Duration
	finishedAt     time.Duration

	// owner is the server-side consumer of this sequence's events.
	owner *choice
}

// ID returns the sequence's ID.
func (q *Sequence) ID() string { return q.id }

// Status returns where the sequence is.
func (q *Sequence) Status() SequenceStatus { return q.status }

// FinishReason returns why the sequence finished, or "" if it has not.
func (q *Sequence) FinishReason() FinishReason { return q.reason }

// Priority returns the sequence's priority.
func (q *Sequence) Priority() int { return q.priority }

// Arrival returns the simulated arrival time.
func (q *Sequence) Arrival() time.Duration { return q.arrival }

// NumPromptTokens returns the prompt length.
func (q *Sequence) NumPromptTokens() int { return len(q.prompt) }

// NumOutputTokens returns the number of tokens sampled so far.
func (q *Sequence) NumOutputTokens() int { return len(q.output) }

// NumTokens returns prompt plus output tokens.
func (q *Sequence) NumTokens() int { return len(q.prompt) + len(q.output) }

// NumComputedTokens returns how many tokens have their KV computed.
func (q *Sequence) NumComputedTokens() int { return q.numComputed }

// NumCachedTokens returns the prefix-cache hit, in tokens, of the
// sequence's first scheduling (the usage's cached_tokens), or 0 before it.
func (q *Sequence) NumCachedTokens() int { return max(q.numCachedTokens, 0) }

// NumPreemptions returns how many times the sequence was preempted.
func (q *Sequence) NumPreemptions() int { return q.numPreemptions }

// NumBlocks returns the number of KV-cache blocks the sequence holds.
func (q *Sequence) NumBlocks() int { return len(q.blocks) }

// Output returns a copy of the sampled token IDs.
func (q *Sequence) Output() []TokenID { return slices.Clone(q.output) }

// QueueTime returns the time from arrival to first scheduling and whether the
// sequence has been scheduled.
func (q *Sequence) QueueTime() (time.Duration, bool) {
	return q.firstScheduled - q.arrival, q.scheduledOnce
}

// TimeToFirstToken returns the time from arrival to the first output token
// and whether there is one.
func (q *Sequence) TimeToFirstToken() (time.Duration, bool) {
	return q.firstToken - q.arrival, q.hasFirstToken
}

// Latency returns the time from arrival to finish and whether the sequence
// has finished.
func (q *Sequence) Latency() (time.Duration, bool) {
	return q.finishedAt - q.arrival, q.status == StatusFinished
}

func (q *Sequence) tokenAt(i int) TokenID {
	if i < len(q.prompt) {
		return q.prompt[i]
	}
	return q.output[i-len(q.prompt)]
}

// Scheduled is one sequence's share of a step.
type Scheduled struct {
	// Seq is the scheduled sequence.
	Seq *Sequence
	// Tokens is the number of tokens computed for it in the step.
	Tokens int
}

// TokenEvent is one output token sampled at the end of a step.
type TokenEvent struct {
	// Seq is the sequence that sampled the token.
	Seq *Sequence
	// Index is the token's position in the output, from 0.
	Index int
	// Token is the sampled token's ID.
	Token TokenID
	// Text is the token's text; empty for the end-of-sequence token.
	Text string
}

// FinishEvent is a sequence finishing at the end of a step.
type FinishEvent struct {
	// Seq is the finished sequence.
	Seq *Sequence
	// Reason is why it finished.
	Reason FinishReason
}

// StepResult is what one engine step did. It is reused by the next Step:
// copy what must outlive it.
type StepResult struct {
	// Start is the simulated time the step began; it ends at Start+Duration.
	Start, Duration time.Duration
	// Scheduled lists the batch: running sequences first, in running
	// order, then the ones admitted from the waiting queue.
	Scheduled []Scheduled
	// PrefillTokens counts the batch's prompt (and recomputed) tokens,
	// DecodeTokens its single-token decodes.
	PrefillTokens, DecodeTokens int
	// Admitted are the sequences moved from waiting to running.
	Admitted []*Sequence
	// Preempted are the sequences evicted back to waiting.
	Preempted []*Sequence
	// Tokens are the tokens sampled at the end of the step.
	Tokens []TokenEvent
	// Finished are the sequences that finished at the end of the step.
	Finished []FinishEvent
}

func (r *StepResult) reset() {
	clear(r.Scheduled)
	clear(r.Admitted)
	clear(r.Preempted)
	clear(r.Tokens)
	clear(r.Finished)
	*r = StepResult{
		Scheduled: r.Scheduled[:0],
		Admitted:  r.Admitted[:0],
		Preempted: r.Preempted[:0],
		Tokens:    r.Tokens[:0],
		Finished:  r.Finished[:0],
	}
}

// Scheduler is a deterministic model of vLLM 0.29's v1 scheduler over
// simulated time. It is a plain state machine: Add and Abort change the
// request set, Step runs one engine iteration and advances the clock by its
// cost. It is not safe for concurrent use.
//
// A step, as vLLM's schedule():
//
//  1. Running sequences, in running order, each get the tokens they still
//     need (one for a decode, the rest of the prompt for a chunked prefill),
//     within the token budget. When the KV cache cannot grow a sequence, a
//     victim is preempted by recomputation — the last admitted under fcfs,
//     the worst (priority, arrival) under priority — until it fits or the
//     sequence itself is the victim.
//  2. Only if nobody was preempted: while the budget lasts and fewer than
//     MaxNumSeqs run, the head of the waiting queue is admitted with its
//     prefix-cache hit, provided its whole sequence fits in the free blocks.
//     A head that does not fit ends admission for the step; nobody is
//     evicted for it, and a waiting request never preempts a running one.
//  3. The step costs DecodeStepBase + DecodeStepPerSeq per sequence in the
//     batch + its prefill tokens / PrefillTokensPerSecond.
//  4. At the end of the step, every sequence whose tokens are all computed
//     samples one token; finished sequences free their blocks.
type Scheduler struct {
	cfg     EngineConfig
	kv      *kvCache
	now     time.Duration
	pending []*Sequence // future arrivals, by (arrival, order)
	waiting waitingQueue
	running []*Sequence

	nextOrder     uint64
	numUnfinished int
	queuedTokens  int // prompt tokens of unfinished sequences with no output yet

	st     counters
	res    StepResult
	inStep bool // between BeginStep and EndStep
	hit    []int32
}

type counters struct {
	preemptions      uint64
	prefixQueries    uint64
	prefixHits       uint64
	promptTokens     uint64
	generationTokens uint64
	finished         [3]uint64 // stop, length, abort
	queueTime        Histogram
	ttft             Histogram
	e2e              Histogram
}

// NewScheduler returns an idle scheduler at simulated time 0.
func NewScheduler(cfg EngineConfig) (*Scheduler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("engine config: %w", err)
	}
	s := &Scheduler{
		cfg:     cfg,
		kv:      newKVCache(cfg.NumGPUBlocks, cfg.BlockSize, cfg.EnablePrefixCaching),
		waiting: newWaitingQueue(cfg.SchedulingPolicy),
	}
	s.st.queueTime = newHistogram(requestLatencyBuckets)
	s.st.ttft = newHistogram(ttftBuckets)
	s.st.e2e = newHistogram(requestLatencyBuckets)
	return s, nil
}

// Config returns the scheduler's configuration.
func (s *Scheduler) Config() EngineConfig { return s.cfg }

// Now returns the simulated time: the end of the last step, or later if
// the clock was advanced to an arrival; during a step, its start.
func (s *Scheduler) Now() time.Duration { return s.now }

// Idle reports whether there is nothing to do: no step in flight and no
// running, waiting or future sequences.
func (s *Scheduler) Idle() bool {
	return !s.inStep && len(s.running) == 0 && s.waiting.len() == 0 && len(s.pending) == 0
}

// CheckAdmission applies vLLM 0.29's admission valves to a request that
// would add n sequences: ErrQueueOverflow when unfinished requests plus n
// exceed MaxNumQueuedReqs, ErrQueuedTokens when the prompt tokens of the
// requests still in prefill already reach MaxNumQueuedTokens.
func (s *Scheduler) CheckAdmission(n int) error {
	if s.cfg.MaxNumQueuedReqs > 0 && s.numUnfinished+n > s.cfg.MaxNumQueuedReqs {
		return ErrQueueOverflow
	}
	if s.cfg.MaxNumQueuedTokens > 0 && s.queuedTokens >= s.cfg.MaxNumQueuedTokens {
		return ErrQueuedTokens
	}
	return nil
}

// Add adds a sequence. Its arrival may lie in the past (it joins the
// waiting queue now) or in the future (it joins when the clock gets there).
func (s *Scheduler) Add(spec SequenceSpec) (*Sequence, error) {
	switch {
	case len(spec.Prompt) == 0:
		return nil, fmt.Errorf("sequence %s: empty prompt", spec.ID)
	case spec.MaxTokens < 0:
		return nil, fmt.Errorf("sequence %s: negative max tokens %d", spec.ID, spec.MaxTokens)
	case len(spec.Prompt) > s.cfg.MaxModelLen || spec.MaxTokens > s.cfg.MaxModelLen-len(spec.Prompt): // no overflow near 2^63
		return nil, fmt.Errorf("sequence %s: %d prompt + %d output tokens exceed max model len %d",
			spec.ID, len(spec.Prompt), spec.MaxTokens, s.cfg.MaxModelLen)
	}
	q := &Sequence{
		id:              spec.ID,
		prompt:          spec.Prompt,
		priority:        spec.Priority,
		arrival:         spec.Arrival,
		maxTokens:       spec.MaxTokens,
		stopAfter:       spec.StopAfter,
		order:           s.nextOrder,
		heapIndex:       -1,
		hashSeed:        cacheSaltSeed(spec.CacheSalt),
		gen:             newGenerator(spec.Seed),
		numCachedTokens: -1,
	}
	s.nextOrder++
	s.numUnfinished++
	s.queuedTokens += len(q.prompt)
	if q.arrival <= s.now {
		q.status = StatusWaiting
		s.waiting.add(q)
		return q, nil
	}
	q.status = StatusPending
	i, _ := slices.BinarySearchFunc(s.pending, q, func(a, b *Sequence) int {
		if a.arrival != b.arrival {
			return cmpDuration(a.arrival, b.arrival)
		}
		return cmpUint64(a.order, b.order)
	})
	s.pending = slices.Insert(s.pending, i, q)
	return q, nil
}

// Abort removes an unfinished sequence, freeing its blocks; it finishes
// with FinishAbort. It reports whether the sequence was unfinished. During
// a step (between BeginStep and EndStep) the aborted sequence gets nothing
// from the step.
func (s *Scheduler) Abort(q *Sequence) bool {
	switch q.status {
	case StatusFinished:
		return false
	case StatusPending:
		if i := slices.Index(s.pending, q); i >= 0 {
			s.pending = slices.Delete(s.pending, i, i+1)
		}
	case StatusWaiting, StatusPreempted:
		s.waiting.remove(q)
	case StatusRunning:
		if i := slices.Index(s.running, q); i >= 0 {
			s.running = slices.Delete(s.running, i, i+1)
		}
		q.scheduled = 0
	}
	s.finish(q, FinishAbort)
	return true
}

// promoteArrivals moves the pending sequences that have arrived by now
// into the waiting queue.
func (s *Scheduler) promoteArrivals() {
	n := 0
	for n < len(s.pending) && s.pending[n].arrival <= s.now {
		q := s.pending[n]
		q.status = StatusWaiting
		s.waiting.add(q)
		n++
	}
	if n > 0 {
		clear(s.pending[:n])
		s.pending = s.pending[n:]
	}
}

// Step runs one engine iteration starting at Now (or, when nothing is
// running or waiting, at the next arrival) and advances the clock to its
// end: BeginStep followed by EndStep. On an idle scheduler it does nothing
// and returns a zero result.
func (s *Scheduler) Step() *StepResult {
	s.BeginStep()
	return s.EndStep()
}

// BeginStep schedules one engine iteration: it admits, preempts and
// allocates blocks, and fills the result's Start, Duration, Scheduled,
// Admitted and Preempted. The clock stays at Start until EndStep, and the
// scheduler's state is the one vLLM has while the forward pass runs: the
// batch is running and holds its blocks, but no token of the step has been
// sampled. Add and Abort may be called before EndStep; a sequence aborted
// meanwhile gets no token from the step. BeginStep must not be called again
// before EndStep.
func (s *Scheduler) BeginStep() *StepResult {
	if s.inStep {
		panic("vllmsim: BeginStep called twice without EndStep")
	}
	res := &s.res
	res.reset()
	s.promoteArrivals()
	if len(s.running) == 0 && s.waiting.len() == 0 {
		if len(s.pending) == 0 {
			res.Start = s.now
			return res
		}
		s.now = s.pending[0].arrival
		s.promoteArrivals()
	}
	s.inStep = true
	res.Start = s.now
	budget := s.cfg.MaxNumBatchedTokens
	if s.scheduleRunning(res, &budget) == 0 {
		s.scheduleWaiting(res, &budget)
	}
	for _, sc := range res.Scheduled {
		q := sc.Seq
		if sc.Tokens == 1 && len(q.output) > 0 && q.numComputed == q.NumTokens()-1 {
			res.DecodeTokens++
		} else {
			res.PrefillTokens += sc.Tokens
		}
	}
	switch {
	case len(res.Scheduled) > 0:
		res.Duration = s.cfg.DecodeStepBase +
			time.Duration(len(res.Scheduled))*s.cfg.DecodeStepPerSeq +
			time.Duration(float64(res.PrefillTokens)/s.cfg.PrefillTokensPerSecond*float64(time.Second))
	case len(res.Preempted) == 0:
		// Nothing could run and nothing changed. A valid configuration never
		// gets here (a lone request always fits); keep time moving anyway.
		res.Duration = s.cfg.DecodeStepBase
	}
	// A step whose only effect was preempting costs nothing: vLLM skips the
	// forward pass when no token is scheduled.
	return res
}

// EndStep completes the iteration begun by BeginStep: the clock moves to
// its end, every scheduled sequence whose tokens are now all computed
// samples a token, and finished sequences free their blocks. It returns the
// result of BeginStep completed with Tokens and Finished. Without a step in
// flight it returns the last result unchanged.
func (s *Scheduler) EndStep() *StepResult {
	res := &s.res
	if !s.inStep {
		return res
	}
	s.inStep = false
	s.now = res.Start + res.Duration
	finished := 0
	for _, sc := range res.Scheduled {
		q := sc.Seq
		if q.status != StatusRunning {
			continue // aborted while the step ran
		}
		q.numComputed += q.scheduled
		q.scheduled = 0
		if q.numComputed < q.NumTokens() {
			continue // a prefill chunk: nothing to sample yet
		}
		if q.maxTokens == 0 {
			s.finish(q, FinishStop)
			res.Finished = append(res.Finished, FinishEvent{Seq: q, Reason: FinishStop})
			finished++
			continue
		}
		s.sample(res, q)
		if reason := s.stopCheck(q); reason != "" {
			s.finish(q, reason)
			res.Finished = append(res.Finished, FinishEvent{Seq: q, Reason: reason})
			finished++
		}
	}
	if finished > 0 {
		s.running = slices.DeleteFunc(s.running, func(q *Sequence) bool { return q.status == StatusFinished })
	}
	return res
}

// scheduleRunning is phase 1 of a step. It returns the number of
// preemptions.
func (s *Scheduler) scheduleRunning(res *StepResult, budget *int) int {
	preempted := 0
	for i := 0; i < len(s.running) && *budget > 0; {
		q := s.running[i]
		n := q.NumTokens() - q.numComputed
		if t := s.cfg.LongPrefillTokenThreshold; t > 0 && n > t {
			n = t
		}
		n = min(n, *budget)
		if n <= 0 {
			i++
			continue
		}
		scheduled := true
		for !s.kv.allocate(q, nil, q.numComputed+n, 0) {
			var victim *Sequence
			if s.cfg.SchedulingPolicy == PolicyPriority {
				vi := 0
				for j, r := range s.running {
					v := s.running[vi]
					if r.priority > v.priority || (r.priority == v.priority && r.arrival > v.arrival) {
						vi = j
					}
				}
				victim = s.running[vi]
				s.running = slices.Delete(s.running, vi, vi+1)
				if victim.scheduled > 0 {
					// Already in this step's batch: take its tokens back.
					*budget += victim.scheduled
					victim.scheduled = 0
					res.Scheduled = slices.DeleteFunc(res.Scheduled, func(sc Scheduled) bool { return sc.Seq == victim })
				}
				if vi < i {
					i--
				}
			} else {
				victim = s.running[len(s.running)-1]
				s.running = s.running[:len(s.running)-1]
			}
			s.preempt(victim)
			res.Preempted = append(res.Preempted, victim)
			preempted++
			if victim == q {
				scheduled = false
				break
			}
		}
		if !scheduled {
			break
		}
		q.scheduled = n
		res.Scheduled = append(res.Scheduled, Scheduled{Seq: q, Tokens: n})
		*budget -= n
		i++
	}
	return preempted
}

// scheduleWaiting is phase 2 of a step.
func (s *Scheduler) scheduleWaiting(res *StepResult, budget *int) {
	for s.waiting.len() > 0 && *budget > 0 && len(s.running) < s.cfg.MaxNumSeqs {
		q := s.waiting.peek()
		s.hit = s.kv.lookup(q, s.hit)
		computed := len(s.hit) * s.cfg.BlockSize
		n := q.NumTokens() - computed
		if t := s.cfg.LongPrefillTokenThreshold; t > 0 && n > t {
			n = t
		}
		n = min(n, *budget)
		if !s.kv.allocate(q, s.hit, computed+n, q.NumTokens()) {
			break // the head does not fit: nobody is evicted for it
		}
		s.waiting.pop()
		if q.numPreemptions == 0 && q.numCachedTokens < 0 {
			s.st.prefixQueries += uint64(q.NumTokens())
			s.st.prefixHits += uint64(computed)
		}
		if q.numCachedTokens < 0 {
			q.numCachedTokens = computed
		}
		if !q.scheduledOnce {
			q.scheduledOnce = true
			q.firstScheduled = s.now
		}
		q.status = StatusRunning
		q.numComputed = computed
		q.scheduled = n
		s.running = append(s.running, q)
		res.Admitted = append(res.Admitted, q)
		res.Scheduled = append(res.Scheduled, Scheduled{Seq: q, Tokens: n})
		*budget -= n
	}
}

// preempt evicts a running sequence by recomputation: its blocks are freed,
// its computed tokens lost, and it goes back to the front of the waiting
// queue (by its original priority and arrival under priority).
func (s *Scheduler) preempt(q *Sequence) {
	s.kv.free(q)
	q.numComputed = 0
	q.scheduled = 0
	q.numPreemptions++
	q.status = StatusPreempted
	s.st.preemptions++
	s.waiting.prepend(q)
}

func (s *Scheduler) sample(res *StepResult, q *Sequence) {
	idx := len(q.output)
	var p piece
	if q.stopAfter > 0 && idx+1 == q.stopAfter {
		p = piece{id: TokenIMEnd} // end of sequence: no text
	} else {
		p = q.gen.next()
	}
	q.output = append(q.output, p.id)
	s.st.generationTokens++
	if !q.hasFirstToken {
		q.hasFirstToken = true
		q.firstToken = s.now
		s.queuedTokens -= len(q.prompt)
		s.st.promptTokens += uint64(len(q.prompt))
		s.st.ttft.observe((s.now - q.arrival).Seconds())
	}
	res.Tokens = append(res.Tokens, TokenEvent{Seq: q, Index: idx, Token: p.id, Text: p.text})
}

// stopCheck is vLLM's check_stop: length caps first, then end-of-sequence.
func (s *Scheduler) stopCheck(q *Sequence) FinishReason {
	if q.NumTokens() >= s.cfg.MaxModelLen || len(q.output) >= q.maxTokens {
		return FinishLength
	}
	if q.stopAfter > 0 && len(q.output) == q.stopAfter {
		return FinishStop
	}
	return ""
}

// finish marks q finished and settles its accounting. The caller removes it
// from the running set.
func (s *Scheduler) finish(q *Sequence, reason FinishReason) {
	q.status = StatusFinished
	q.reason = reason
	q.finishedAt = s.now
	s.kv.free(q)
	s.numUnfinished--
	if !q.hasFirstToken {
		s.queuedTokens -= len(q.prompt)
		if reason != FinishAbort {
			s.st.promptTokens += uint64(len(q.prompt))
		}
	}
	switch reason {
	case FinishStop:
		s.st.finished[0]++
	case FinishLength:
		s.st.finished[1]++
	case FinishAbort:
		s.st.finished[2]++
		return
	}
	if q.scheduledOnce {
		s.st.queueTime.observe((q.firstScheduled - q.arrival).Seconds())
	}
	s.st.e2e.observe((s.now - q.arrival).Seconds())
}

// Stats is a snapshot of the scheduler's gauges and counters, in vLLM's
// terms. Times are simulated.
type Stats struct {
	// Now is the simulated time of the snapshot.
	Now time.Duration
	// NumRunning and NumWaiting are vllm:num_requests_running and
	// vllm:num_requests_waiting (future arrivals count as waiting).
	NumRunning, NumWaiting int
	// KVCacheUsage is vllm:kv_cache_usage_perc, a fraction in [0, 1].
	KVCacheUsage float64
	// NumFreeBlocks is the number of free KV blocks (cached ones included).
	NumFreeBlocks int
	// NumPreemptions is vllm:num_preemptions_total.
	NumPreemptions uint64
	// PrefixCacheQueries and PrefixCacheHits are vllm:prefix_cache_*_total,
	// in tokens, counted once per request at its first admission.
	PrefixCacheQueries, PrefixCacheHits uint64
	// PromptTokens and GenerationTokens are vllm:prompt_tokens_total and
	// vllm:generation_tokens_total.
	PromptTokens, GenerationTokens uint64
	// FinishedStop, FinishedLength and FinishedAbort are
	// vllm:request_success_total by finished_reason.
	FinishedStop, FinishedLength, FinishedAbort uint64
	// QueuedPrefillTokens is what max-num-queued-tokens is compared with.
	QueuedPrefillTokens int
	// NumUnfinished is what max-num-queued-reqs is compared with.
	NumUnfinished int
	// QueueTime is vllm:request_queue_time_seconds, observed at finish.
	QueueTime Histogram
	// TimeToFirstToken is vllm:time_to_first_token_seconds.
	TimeToFirstToken Histogram
	// E2ELatency is vllm:e2e_request_latency_seconds, observed at finish.
	E2ELatency Histogram
}

// Stats returns a snapshot of the scheduler's metrics.
func (s *Scheduler) Stats() Stats {
	return Stats{
		Now:                 s.now,
		NumRunning:          len(s.running),
		NumWaiting:          s.waiting.len() + len(s.pending),
		KVCacheUsage:        s.kv.usage(),
		NumFreeBlocks:       s.kv.numFree,
		NumPreemptions:      s.st.preemptions,
		PrefixCacheQueries:  s.st.prefixQueries,
		PrefixCacheHits:     s.st.prefixHits,
		PromptTokens:        s.st.promptTokens,
		GenerationTokens:    s.st.generationTokens,
		FinishedStop:        s.st.finished[0],
		FinishedLength:      s.st.finished[1],
		FinishedAbort:       s.st.finished[2],
		QueuedPrefillTokens: s.queuedTokens,
		NumUnfinished:       s.numUnfinished,
		QueueTime:           s.st.queueTime.clone(),
		TimeToFirstToken:    s.st.ttft.clone(),
		E2ELatency:          s.st.e2e.clone(),
	}
}

// Running returns the running sequences in running order.
func (s *Scheduler) Running() []*Sequence { return slices.Clone(s.running) }

// Waiting returns the waiting sequences in the order they would be admitted.
func (s *Scheduler) Waiting() []*Sequence {
	out := make([]*Sequence, 0, s.waiting.len())
	s.waiting.each(func(q *Sequence) { out = append(out, q) })
	if s.cfg.SchedulingPolicy == PolicyPriority {
		slices.SortFunc(out, func(a, b *Sequence) int {
			if seqLess(a, b) {
				return -1
			}
			return 1
		})
	}
	return out
}

func cacheSaltSeed(salt string) uint64 {
	h := uint64(0x6a09e667f3bcc908)
	for i := 0; i < len(salt); i++ {
		h = mix64(h ^ uint64(salt[i]))
	}
	return h
}

func cmpDuration(a, b time.Duration) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func cmpUint64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
