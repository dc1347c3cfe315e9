package vllmsim

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

const ms = time.Millisecond

// testEngine is a small engine whose costs are easy to add up by hand:
// every step costs 10 ms plus 1 ms per prefill token, nothing per sequence.
func testEngine(mod func(*EngineConfig)) EngineConfig {
	c := EngineConfig{
		MaxNumSeqs:             4,
		MaxModelLen:            256,
		NumGPUBlocks:           65, // 64 usable blocks of 4 tokens
		BlockSize:              4,
		SchedulingPolicy:       PolicyFCFS,
		EnablePrefixCaching:    true,
		MaxNumBatchedTokens:    64,
		PrefillTokensPerSecond: 1000,
		DecodeStepBase:         10 * ms,
		DecodeStepPerSeq:       0,
	}
	if mod != nil {
		mod(&c)
	}
	return c
}

func newTestScheduler(t *testing.T, cfg EngineConfig) *Scheduler {
	t.Helper()
	s, err := NewScheduler(cfg)
	if err != nil {
		t.Fatalf("NewScheduler: %v", err)
	}
	return s
}

// ids returns n distinct synthetic token IDs starting at base.
func ids(base, n int) []TokenID {
	out := make([]TokenID, n)
	for i := range out {
		out[i] = TokenID(base + i)
	}
	return out
}

func mustAdd(t *testing.T, s *Scheduler, spec SequenceSpec) *Sequence {
	t.Helper()
	q, err := s.Add(spec)
	if err != nil {
		t.Fatalf("Add(%s): %v", spec.ID, err)
	}
	return q
}

// stepRecord is a copy of one StepResult plus the running set after it.
type stepRecord struct {
	start, end time.Duration
	scheduled  map[string]int
	admitted   []string
	preempted  []string
	tokens     []string
	finished   []string
	running    []string
	waiting    []string
}

func (r stepRecord) String() string {
	return fmt.Sprintf("[%v-%v] sched=%v adm=%v pre=%v tok=%v fin=%v run=%v wait=%v",
		r.start, r.end, r.scheduled, r.admitted, r.preempted, r.tokens, r.finished, r.running, r.waiting)
}

func seqIDs(qs []*Sequence) []string {
	out := make([]string, len(qs))
	for i, q := range qs {
		out[i] = q.ID()
	}
	return out
}

func step(t *testing.T, s *Scheduler) stepRecord {
	t.Helper()
	res := s.Step()
	r := stepRecord{start: res.Start, end: res.Start + res.Duration, scheduled: map[string]int{}}
	for _, sc := range res.Scheduled {
		r.scheduled[sc.Seq.ID()] = sc.Tokens
	}
	r.admitted = seqIDs(res.Admitted)
	r.preempted = seqIDs(res.Preempted)
	for _, ev := range res.Tokens {
		r.tokens = append(r.tokens, ev.Seq.ID())
	}
	for _, ev := range res.Finished {
		r.finished = append(r.finished, ev.Seq.ID()+":"+string(ev.Reason))
	}
	r.running = seqIDs(s.Running())
	r.waiting = seqIDs(s.Waiting())
	if len(r.running) > s.Config().MaxNumSeqs {
		t.Fatalf("running set %v exceeds max_num_seqs %d", r.running, s.Config().MaxNumSeqs)
	}
	if got := s.Now(); got != r.end {
		t.Fatalf("clock at %v after a step ending at %v", got, r.end)
	}
	return r
}

// runAll steps until idle and returns the timeline.
func runAll(t *testing.T, s *Scheduler) []stepRecord {
	t.Helper()
	var out []stepRecord
	for i := 0; !s.Idle(); i++ {
		if i > 100000 {
			t.Fatal("scheduler did not drain")
		}
		out = append(out, step(t, s))
	}
	return out
}

func wantDur(t *testing.T, what string, got, want time.Duration) {
	t.Helper()
	if got != want {
		t.Errorf("%s = %v, want %v", what, got, want)
	}
}

func wantIDs(t *testing.T, what string, got []string, want ...string) {
	t.Helper()
	if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
		t.Errorf("%s = %v, want %v", what, got, want)
	}
}

func queueTime(t *testing.T, q *Sequence) time.Duration {
	t.Helper()
	d, ok := q.QueueTime()
	if !ok {
		t.Fatalf("%s was never scheduled", q.ID())
	}
	return d
}

func ttft(t *testing.T, q *Sequence) time.Duration {
	t.Helper()
	d, ok := q.TimeToFirstToken()
	if !ok {
		t.Fatalf("%s has no first token", q.ID())
	}
	return d
}

// Three 10-token prompts arrive together on an engine that runs two
// sequences; each generates 3 tokens.
//
//	 0– 30  A,B prefill (10 + 20 ms)  → A1 B1
//	30– 40  A,B decode                → A2 B2
//	40– 50  A,B decode                → A3 B3, both finish (length)
//	50– 70  C prefill (10 + 10 ms)    → C1     (C queued 50 ms)
//	70– 80  C decode                  → C2
//	80– 90  C decode                  → C3, finishes
func TestSchedulerRespectsMaxNumSeqs(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxNumSeqs = 2 }))
	a := mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 10), MaxTokens: 3})
	b := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 10), MaxTokens: 3})
	c := mustAdd(t, s, SequenceSpec{ID: "C", Prompt: ids(3000, 10), MaxTokens: 3})

	tl := runAll(t, s)
	if len(tl) != 6 {
		t.Fatalf("got %d steps, want 6:\n%v", len(tl), tl)
	}
	wantStarts := []time.Duration{0, 30 * ms, 40 * ms, 50 * ms, 70 * ms, 80 * ms}
	for i, r := range tl {
		wantDur(t, fmt.Sprintf("step %d start", i), r.start, wantStarts[i])
	}
	wantIDs(t, "step 0 admitted", tl[0].admitted, "A", "B")
	wantIDs(t, "step 0 waiting", tl[0].waiting, "C")
	wantIDs(t, "step 2 finished", tl[2].finished, "A:length", "B:length")
	wantIDs(t, "step 3 admitted", tl[3].admitted, "C")
	wantIDs(t, "step 5 finished", tl[5].finished, "C:length")
	if tl[0].scheduled["A"] != 10 || tl[1].scheduled["A"] != 1 {
		t.Errorf("A scheduled %d then %d tokens, want 10 then 1", tl[0].scheduled["A"], tl[1].scheduled["A"])
	}
	wantDur(t, "A TTFT", ttft(t, a), 30*ms)
	wantDur(t, "B TTFT", ttft(t, b), 30*ms)
	wantDur(t, "C queue time", queueTime(t, c), 50*ms)
	wantDur(t, "C TTFT", ttft(t, c), 70*ms)
	for _, q := range []*Sequence{a, b, c} {
		if q.NumOutputTokens() != 3 || q.FinishReason() != FinishLength {
			t.Errorf("%s: %d tokens, %q; want 3, length", q.ID(), q.NumOutputTokens(), q.FinishReason())
		}
	}
}

// Under the priority policy a high-priority arrival waits for a free slot:
// nobody running is preempted for it, but it overtakes an earlier,
// lower-priority waiting request.
//
//	A (prio 5, 5 tokens) and B (prio 5, 8 tokens) arrive at 0; L (prio 5)
//	at 1 ms; H (prio -10) at 35 ms. Two slots.
//	 0– 30  A,B prefill          → A1 B1
//	30– 70  A,B decode ×4        → A finishes at 70 (5 tokens)
//	70– 90  B decode + H prefill → H1 (H queued 35 ms, TTFT 55 ms)
//	L waits until B finishes.
func TestSchedulerPriorityArrivalDoesNotPreemptRunning(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) {
		c.MaxNumSeqs = 2
		c.SchedulingPolicy = PolicyPriority
	}))
	a := mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 10), MaxTokens: 5, Priority: 5})
	b := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 10), MaxTokens: 8, Priority: 5})
	l := mustAdd(t, s, SequenceSpec{ID: "L", Prompt: ids(3000, 10), MaxTokens: 2, Priority: 5, Arrival: 1 * ms})
	h := mustAdd(t, s, SequenceSpec{ID: "H", Prompt: ids(4000, 10), MaxTokens: 2, Priority: -10, Arrival: 35 * ms})

	tl := runAll(t, s)
	var hAdmitted, lAdmitted time.Duration = -1, -1
	for i, r := range tl {
		if len(r.preempted) > 0 {
			t.Fatalf("step %d preempted %v: a waiting request must never evict a running one", i, r.preempted)
		}
		if r.end < 70*ms {
			wantIDs(t, fmt.Sprintf("running after step %d", i), r.running, "A", "B")
		}
		if r.start < 70*ms {
			if r.scheduled["A"] == 0 || r.scheduled["B"] == 0 {
				t.Errorf("step %d at %v did not schedule both running requests: %v", i, r.start, r.scheduled)
			}
		}
		if slices.Contains(r.admitted, "H") {
			hAdmitted = r.start
		}
		if slices.Contains(r.admitted, "L") {
			lAdmitted = r.start
		}
	}
	wantDur(t, "H admitted at", hAdmitted, 70*ms)
	wantDur(t, "H queue time", queueTime(t, h), 35*ms)
	wantDur(t, "H TTFT", ttft(t, h), 55*ms)
	if lAdmitted <= hAdmitted {
		t.Errorf("L (earlier, priority 5) admitted at %v, not after H (priority -10) at %v", lAdmitted, hAdmitted)
	}
	if st := s.Stats(); st.NumPreemptions != 0 {
		t.Errorf("preemptions = %d, want 0", st.NumPreemptions)
	}
	for _, q := range []*Sequence{a, b, l, h} {
		if q.NumPreemptions() != 0 || q.Status() != StatusFinished {
			t.Errorf("%s: %d preemptions, status %v", q.ID(), q.NumPreemptions(), q.Status())
		}
	}
}

// kvPressure runs three 8-token prompts on 8 usable blocks of 4 tokens. B
// (priority 2) arrives first; A (priority 0) and C (priority 1) at 1 ms.
//
//	 0–18  B prefill                       → B1 (B: 2 blocks)
//	18–44  B decode (3rd block), A and C prefill → B2 A1 C1 (7 blocks held)
//	44–    B fits; A takes the last free block; C needs one more: preempt.
func kvPressure(t *testing.T, policy Policy) (*Scheduler, map[string]*Sequence, stepRecord) {
	t.Helper()
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) {
		c.NumGPUBlocks = 9
		c.MaxModelLen = 32
		c.SchedulingPolicy = policy
	}))
	seqs := map[string]*Sequence{}
	for i, spec := range []SequenceSpec{
		{ID: "A", Priority: 0, Arrival: 1 * ms},
		{ID: "B", Priority: 2},
		{ID: "C", Priority: 1, Arrival: 1 * ms},
	} {
		spec.Prompt = ids(1000*(i+1), 8)
		spec.MaxTokens = 6
		spec.Seed = uint64(i + 1)
		seqs[spec.ID] = mustAdd(t, s, spec)
	}
	first := step(t, s)
	wantIDs(t, "step 0 admitted", first.admitted, "B")
	wantDur(t, "step 0 end", first.end, 18*ms)
	second := step(t, s)
	wantIDs(t, "step 1 admitted", second.admitted, "A", "C")
	wantDur(t, "step 1 end", second.end, 44*ms)
	if second.scheduled["B"] != 1 {
		t.Errorf("step 1 scheduled %v, want B:1", second.scheduled)
	}
	return s, seqs, step(t, s)
}

// Under fcfs the victim is the last admitted (C), here the request that
// needed the block itself, so the step schedules only B and A.
func TestSchedulerKVExhaustionEvictsLastAdmittedUnderFCFS(t *testing.T) {
	s, seqs, r := kvPressure(t, PolicyFCFS)
	wantIDs(t, "preempted", r.preempted, "C")
	if r.scheduled["A"] != 1 || r.scheduled["B"] != 1 || r.scheduled["C"] != 0 {
		t.Errorf("scheduled %v, want A:1 B:1", r.scheduled)
	}
	if len(r.admitted) != 0 {
		t.Errorf("a step with a preemption admitted %v", r.admitted)
	}
	checkVictim(t, s, seqs["C"], r, 1)
	wantIDs(t, "running", r.running, "B", "A")
	drainMatchesReference(t, s, seqs)
}

// Under priority the victim is the worst (priority, arrival) — B, priority 2
// — although it was admitted first and already scheduled in this step: its
// tokens go back to the budget and C runs instead.
func TestSchedulerKVExhaustionEvictsWorstPriorityUnderPriority(t *testing.T) {
	s, seqs, r := kvPressure(t, PolicyPriority)
	wantIDs(t, "preempted", r.preempted, "B")
	if r.scheduled["A"] != 1 || r.scheduled["C"] != 1 || r.scheduled["B"] != 0 {
		t.Errorf("scheduled %v, want A:1 C:1", r.scheduled)
	}
	checkVictim(t, s, seqs["B"], r, 2)
	wantIDs(t, "running", r.running, "A", "C")
	drainMatchesReference(t, s, seqs)
}

func checkVictim(t *testing.T, s *Scheduler, v *Sequence, r stepRecord, outputs int) {
	t.Helper()
	if v.Status() != StatusPreempted || v.NumComputedTokens() != 0 || v.NumBlocks() != 0 {
		t.Errorf("victim %s: status %v, %d computed tokens, %d blocks; want preempted, 0, 0",
			v.ID(), v.Status(), v.NumComputedTokens(), v.NumBlocks())
	}
	if v.NumOutputTokens() != outputs {
		t.Errorf("victim %s kept %d output tokens, want %d", v.ID(), v.NumOutputTokens(), outputs)
	}
	wantIDs(t, "waiting", r.waiting, v.ID())
	if st := s.Stats(); st.NumPreemptions != 1 {
		t.Errorf("preemptions = %d, want 1", st.NumPreemptions)
	}
}

// drainMatchesReference finishes the run and checks that preemption cost
// time but not output: every sequence produces what it would on an
// unconstrained engine.
func drainMatchesReference(t *testing.T, s *Scheduler, seqs map[string]*Sequence) {
	t.Helper()
	runAll(t, s)
	ref := newTestScheduler(t, testEngine(nil))
	for i, id := range []string{"A", "B", "C"} {
		q := mustAdd(t, ref, SequenceSpec{ID: id, Prompt: ids(1000*(i+1), 8), MaxTokens: 6, Seed: uint64(i + 1)})
		seqs["ref"+id] = q
	}
	runAll(t, ref)
	for _, id := range []string{"A", "B", "C"} {
		got, want := seqs[id].Output(), seqs["ref"+id].Output()
		if !slices.Equal(got, want) {
			t.Errorf("%s output after preemption %v, want %v", id, got, want)
		}
		if seqs[id].FinishReason() != FinishLength {
			t.Errorf("%s finished %q", id, seqs[id].FinishReason())
		}
	}
	if st := s.Stats(); st.NumFreeBlocks != 8 || st.KVCacheUsage != 0 {
		t.Errorf("after draining: %d free blocks, usage %v; want 8, 0", st.NumFreeBlocks, st.KVCacheUsage)
	}
}

// When the waiting head does not fit in the free blocks, admission stops
// for the step: nobody is evicted for it, and a small request behind it is
// not admitted either.
//
//	10 usable blocks of 4 tokens. A: 20-token prompt, 8 tokens out.
//	B: 24-token prompt (6 blocks), C: 4-token prompt (1 block).
//	 0– 30  A prefill: 5 blocks held, 5 free; B needs 6: B and C wait.
//	30–100  A decodes 7 more tokens and finishes.
//	100     B and C admitted together.
func TestSchedulerWaitingHeadThatDoesNotFitEvictsNobody(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) {
		c.NumGPUBlocks = 11
		c.MaxModelLen = 40
	}))
	a := mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 20), MaxTokens: 8})
	b := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 24), MaxTokens: 4})
	c := mustAdd(t, s, SequenceSpec{ID: "C", Prompt: ids(3000, 4), MaxTokens: 4})

	tl := runAll(t, s)
	wantIDs(t, "step 0 admitted", tl[0].admitted, "A")
	wantIDs(t, "step 0 waiting", tl[0].waiting, "B", "C")
	for i, r := range tl {
		if len(r.preempted) > 0 {
			t.Fatalf("step %d preempted %v", i, r.preempted)
		}
		if r.start < 100*ms && r.scheduled["A"] == 0 {
			t.Errorf("A not scheduled in step %d at %v", i, r.start)
		}
	}
	if lat, ok := a.Latency(); !ok || lat != 100*ms {
		t.Errorf("A latency %v (finished %v), want 100ms", lat, ok)
	}
	wantDur(t, "B queue time", queueTime(t, b), 100*ms)
	wantDur(t, "C queue time (behind the head)", queueTime(t, c), 100*ms)
	wantDur(t, "C TTFT", ttft(t, c), 100*ms+10*ms+28*ms)
}

// Decodes of running requests go first; a long prompt is prefilled in
// chunks of what is left of the budget.
//
//	Budget 16. A (4-token prompt) starts alone; B (40 tokens) arrives at 5 ms.
//	 0–14  A prefill 4                    → A1
//	14–39  A decode 1 + B chunk 15        → A2
//	39–64  A decode 1 + B chunk 15        → A3
//	64–84  A decode 1 + B chunk 10 (last) → A4, B1
func TestSchedulerChunkedPrefillAfterDecodes(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxNumBatchedTokens = 16 }))
	mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 4), MaxTokens: 10})
	b := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 40), MaxTokens: 2, Arrival: 5 * ms})

	want := []struct {
		start  time.Duration
		a, b   int
		tokens []string
	}{
		{0, 4, 0, []string{"A"}},
		{14 * ms, 1, 15, []string{"A"}},
		{39 * ms, 1, 15, []string{"A"}},
		{64 * ms, 1, 10, []string{"A", "B"}},
	}
	for i, w := range want {
		r := step(t, s)
		wantDur(t, fmt.Sprintf("step %d start", i), r.start, w.start)
		if r.scheduled["A"] != w.a || r.scheduled["B"] != w.b {
			t.Errorf("step %d scheduled %v, want A:%d B:%d", i, r.scheduled, w.a, w.b)
		}
		wantIDs(t, fmt.Sprintf("step %d tokens", i), r.tokens, w.tokens...)
	}
	wantDur(t, "B TTFT", ttft(t, b), 84*ms-5*ms)
}

// The second turn of a conversation hits the prefix cache for the blocks
// of the first turn's prompt and answer, and pays prefill only for the rest.
func TestSchedulerSecondTurnHitsPrefixCache(t *testing.T) {
	const bs = 16
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) {
		c.BlockSize = bs
		c.NumGPUBlocks = 257
		c.MaxModelLen = 4096
		c.MaxNumBatchedTokens = 4096
	}))
	msgs := []chatMessage{
		{Role: "system", Content: jsonString(FillerText(1, 300))},
		{Role: "user", Content: jsonString(FillerText(2, 50))},
	}
	text1, aerr := renderChat(msgs, nil)
	if aerr != nil {
		t.Fatal(aerr)
	}
	p1 := Tokenize(text1)
	turn1 := mustAdd(t, s, SequenceSpec{ID: "turn1", Prompt: p1, MaxTokens: 100, StopAfter: 40, Seed: 7})
	var answer strings.Builder
	for !s.Idle() {
		for _, ev := range s.Step().Tokens {
			answer.WriteString(ev.Text)
		}
	}
	if turn1.FinishReason() != FinishStop || turn1.NumOutputTokens() != 40 {
		t.Fatalf("turn 1: %q after %d tokens, want stop after 40", turn1.FinishReason(), turn1.NumOutputTokens())
	}
	if got := turn1.NumCachedTokens(); got != 0 {
		t.Errorf("turn 1 cached tokens = %d, want 0", got)
	}

	msgs = append(msgs,
		chatMessage{Role: "assistant", Content: jsonString(answer.String())},
		chatMessage{Role: "user", Content: jsonString(FillerText(3, 30))})
	text2, aerr := renderChat(msgs, nil)
	if aerr != nil {
		t.Fatal(aerr)
	}
	p2 := Tokenize(text2)
	// The template and tokenizer are prefix-stable: turn 2 starts with turn
	// 1's prompt and answer, end-of-sequence token included.
	prev := append(slices.Clone(p1), turn1.Output()...)
	if !slices.Equal(p2[:len(prev)], prev) {
		t.Fatal("turn 2 does not start with turn 1's prompt and answer")
	}
	// Turn 1 computed every token but the last sampled one; its full blocks
	// stayed cached after it finished.
	wantCached := (len(prev) - 1) / bs * bs
	start := s.Now()
	turn2 := mustAdd(t, s, SequenceSpec{ID: "turn2", Prompt: p2, MaxTokens: 5, Arrival: start})
	r := s.Step()
	if got := turn2.NumCachedTokens(); got != wantCached {
		t.Errorf("turn 2 cached tokens = %d, want %d", got, wantCached)
	}
	wantDur(t, "turn 2 prefill step", r.Duration, 10*ms+time.Duration(len(p2)-wantCached)*ms)
	st := s.Stats()
	if st.PrefixCacheQueries != uint64(len(p1)+len(p2)) || st.PrefixCacheHits != uint64(wantCached) {
		t.Errorf("prefix cache queries/hits = %d/%d, want %d/%d",
			st.PrefixCacheQueries, st.PrefixCacheHits, len(p1)+len(p2), wantCached)
	}
}

// With prefix caching off nothing is reused.
func TestSchedulerPrefixCachingDisabled(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.EnablePrefixCaching = false }))
	mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1, 40), MaxTokens: 2})
	runAll(t, s)
	q := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(1, 40), MaxTokens: 2, Arrival: s.Now()})
	r := step(t, s)
	if q.NumCachedTokens() != 0 || r.scheduled["B"] != 40 {
		t.Errorf("cached %d, scheduled %d; want 0, 40", q.NumCachedTokens(), r.scheduled["B"])
	}
}

// The metrics agree with the timeline of TestSchedulerRespectsMaxNumSeqs.
func TestSchedulerMetricsAgreeWithTimeline(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxNumSeqs = 2 }))
	for i, id := range []string{"A", "B", "C"} {
		mustAdd(t, s, SequenceSpec{ID: id, Prompt: ids(1000*(i+1), 10), MaxTokens: 3})
	}
	step(t, s)
	m := scrape(t, s.Stats())
	wantMetric(t, m, "vllm:num_requests_running", 2)
	wantMetric(t, m, "vllm:num_requests_waiting", 1)
	// A and B hold ceil(10/4) = 3 blocks each of 64.
	wantMetric(t, m, "vllm:kv_cache_usage_perc", 6.0/64)
	wantMetric(t, m, "vllm:time_to_first_token_seconds_count", 2)
	wantMetric(t, m, "vllm:time_to_first_token_seconds_sum", 0.060)
	wantMetric(t, m, "vllm:request_queue_time_seconds_count", 0) // observed at finish
	runAll(t, s)

	m = scrape(t, s.Stats())
	wantMetric(t, m, "vllm:num_requests_running", 0)
	wantMetric(t, m, "vllm:num_requests_waiting", 0)
	wantMetric(t, m, "vllm:kv_cache_usage_perc", 0)
	wantMetric(t, m, "vllm:num_preemptions_total", 0)
	wantMetric(t, m, "vllm:prefix_cache_queries_total", 30)
	wantMetric(t, m, "vllm:prefix_cache_hits_total", 0)
	wantMetric(t, m, "vllm:prompt_tokens_total", 30)
	wantMetric(t, m, "vllm:generation_tokens_total", 9)
	wantMetric(t, m, `vllm:request_success_total{finished_reason="length"}`, 3)
	wantMetric(t, m, `vllm:request_success_total{finished_reason="stop"}`, 0)
	// Queue times 0, 0, 50 ms; TTFT 30, 30, 70 ms; e2e 50, 50, 90 ms.
	wantMetric(t, m, "vllm:request_queue_time_seconds_count", 3)
	wantMetric(t, m, "vllm:request_queue_time_seconds_sum", 0.050)
	wantMetric(t, m, `vllm:request_queue_time_seconds_bucket{le="0.3"}`, 3)
	wantMetric(t, m, "vllm:time_to_first_token_seconds_count", 3)
	wantMetric(t, m, "vllm:time_to_first_token_seconds_sum", 0.130)
	wantMetric(t, m, `vllm:time_to_first_token_seconds_bucket{le="0.04"}`, 2)
	wantMetric(t, m, `vllm:time_to_first_token_seconds_bucket{le="0.06"}`, 2)
	wantMetric(t, m, `vllm:time_to_first_token_seconds_bucket{le="0.08"}`, 3)
	wantMetric(t, m, `vllm:time_to_first_token_seconds_bucket{le="+Inf"}`, 3)
	wantMetric(t, m, "vllm:e2e_request_latency_seconds_sum", 0.190)
}

// scrape renders stats in the exposition format and parses it back into
// samples keyed by name plus the labels other than engine and model_name.
func scrape(t *testing.T, st Stats) map[string]float64 {
	t.Helper()
	var b strings.Builder
	if err := writeMetrics(&b, "test-model", st); err != nil {
		t.Fatal(err)
	}
	return parseExposition(t, b.String(), "test-model")
}

func parseExposition(t *testing.T, text, model string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	types := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(text), "\n") {
		if f, ok := strings.CutPrefix(line, "# TYPE "); ok {
			parts := strings.Fields(f)
			types[parts[0]] = parts[1]
			continue
		}
		if strings.HasPrefix(line, "#") {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		if sp < 0 {
			t.Fatalf("bad sample line %q", line)
		}
		var v float64
		if _, err := fmt.Sscan(line[sp+1:], &v); err != nil && line[sp+1:] != "+Inf" {
			t.Fatalf("bad value in %q: %v", line, err)
		}
		name, labels, _ := strings.Cut(line[:sp], "{")
		labels = strings.TrimSuffix(labels, "}")
		var keep []string
		sawModel := false
		for _, l := range strings.Split(labels, ",") {
			switch {
			case l == `model_name="`+model+`"`:
				sawModel = true
			case l == `engine="0"` || l == "":
			default:
				keep = append(keep, l)
			}
		}
		if !sawModel {
			t.Errorf("sample %q lacks model_name", line)
		}
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		if types[name] == "" && types[base] == "" {
			t.Errorf("sample %q has no TYPE line", line)
		}
		key := name
		if len(keep) > 0 {
			key += "{" + strings.Join(keep, ",") + "}"
		}
		out[key] = v
	}
	return out
}

func wantMetric(t *testing.T, m map[string]float64, key string, want float64) {
	t.Helper()
	got, ok := m[key]
	if !ok {
		t.Errorf("metric %s missing", key)
		return
	}
	if math.Abs(got-want) > 1e-9 {
		t.Errorf("metric %s = %v, want %v", key, got, want)
	}
}

func TestSchedulerAdmissionValves(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) {
		c.MaxNumQueuedReqs = 3
		c.MaxNumQueuedTokens = 25
	}))
	if err := s.CheckAdmission(1); err != nil {
		t.Fatalf("empty engine: %v", err)
	}
	mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 10), MaxTokens: 3})
	mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 10), MaxTokens: 3})
	// 2 unfinished + 2 would exceed 3.
	if err := s.CheckAdmission(2); !errors.Is(err, ErrQueueOverflow) {
		t.Errorf("CheckAdmission(2) = %v, want ErrQueueOverflow", err)
	}
	// 20 queued prompt tokens are below 25.
	if err := s.CheckAdmission(1); err != nil {
		t.Errorf("CheckAdmission(1) = %v, want nil", err)
	}
	mustAdd(t, s, SequenceSpec{ID: "C", Prompt: ids(3000, 5), MaxTokens: 3})
	if err := s.CheckAdmission(1); !errors.Is(err, ErrQueueOverflow) {
		t.Errorf("3 unfinished: %v, want ErrQueueOverflow", err)
	}
	s2 := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxNumQueuedTokens = 25 }))
	mustAdd(t, s2, SequenceSpec{ID: "A", Prompt: ids(1000, 25), MaxTokens: 3})
	if err := s2.CheckAdmission(1); !errors.Is(err, ErrQueuedTokens) {
		t.Errorf("25 queued tokens: %v, want ErrQueuedTokens", err)
	}
	step(t, s2) // A's prefill produces its first token: it leaves the backlog
	if err := s2.CheckAdmission(1); err != nil {
		t.Errorf("after A's first token: %v", err)
	}
	if st := s2.Stats(); st.QueuedPrefillTokens != 0 || st.NumUnfinished != 1 {
		t.Errorf("queued tokens %d, unfinished %d; want 0, 1", st.QueuedPrefillTokens, st.NumUnfinished)
	}
}

func TestSchedulerAbortFreesEverything(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxNumSeqs = 1 }))
	a := mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1000, 10), MaxTokens: 50})
	b := mustAdd(t, s, SequenceSpec{ID: "B", Prompt: ids(2000, 10), MaxTokens: 50})
	f := mustAdd(t, s, SequenceSpec{ID: "F", Prompt: ids(3000, 10), MaxTokens: 50, Arrival: time.Hour})
	step(t, s)
	for _, q := range []*Sequence{a, b, f} {
		if !s.Abort(q) {
			t.Errorf("Abort(%s) = false", q.ID())
		}
		if s.Abort(q) {
			t.Errorf("second Abort(%s) = true", q.ID())
		}
		if q.FinishReason() != FinishAbort {
			t.Errorf("%s finish reason %q", q.ID(), q.FinishReason())
		}
	}
	if !s.Idle() {
		t.Error("not idle after aborting everything")
	}
	st := s.Stats()
	if st.KVCacheUsage != 0 || st.FinishedAbort != 3 || st.NumUnfinished != 0 || st.QueuedPrefillTokens != 0 {
		t.Errorf("after aborts: %+v", st)
	}
	if st.E2ELatency.Count != 0 {
		t.Errorf("aborted requests observed in e2e latency")
	}
}

// An idle scheduler jumps to the next arrival; Step on an idle scheduler
// does nothing.
func TestSchedulerIdleAndFutureArrivals(t *testing.T) {
	s := newTestScheduler(t, testEngine(nil))
	if r := s.Step(); r.Duration != 0 || len(r.Scheduled) != 0 {
		t.Errorf("idle step: %+v", r)
	}
	q := mustAdd(t, s, SequenceSpec{ID: "A", Prompt: ids(1, 10), MaxTokens: 1, Arrival: 2 * time.Second})
	if s.Idle() || q.Status() != StatusPending {
		t.Fatalf("future arrival: idle=%v status=%v", s.Idle(), q.Status())
	}
	if st := s.Stats(); st.NumWaiting != 1 {
		t.Errorf("waiting = %d, want 1 (future arrivals count)", st.NumWaiting)
	}
	r := step(t, s)
	wantDur(t, "start", r.start, 2*time.Second)
	wantDur(t, "queue time", queueTime(t, q), 0)
}

func TestSchedulerRejectsBadSpecs(t *testing.T) {
	s := newTestScheduler(t, testEngine(func(c *EngineConfig) { c.MaxModelLen = 20 }))
	for _, spec := range []SequenceSpec{
		{ID: "empty", MaxTokens: 1},
		{ID: "negative", Prompt: ids(1, 4), MaxTokens: -1},
		{ID: "too-long", Prompt: ids(1, 15), MaxTokens: 6},
	} {
		if _, err := s.Add(spec); err == nil {
			t.Errorf("Add(%s) accepted", spec.ID)
		}
	}
}

// Generated text depends only on the sequence's seed, not on what else runs.
func TestSchedulerOutputIsDeterministic(t *testing.T) {
	run := func(extra int) [][]TokenID {
		s := newTestScheduler(t, testEngine(nil))
		var seqs []*Sequence
		for i := range 3 {
			seqs = append(seqs, mustAdd(t, s, SequenceSpec{
				ID: fmt.Sprint(i), Prompt: ids(100*i+1, 12), MaxTokens: 30, StopAfter: 20 + i, Seed: uint64(i),
			}))
		}
		for i := range extra {
			mustAdd(t, s, SequenceSpec{ID: fmt.Sprint("x", i), Prompt: ids(9000+i, 30), MaxTokens: 7, Seed: 99})
		}
		runAll(t, s)
		out := make([][]TokenID, len(seqs))
		for i, q := range seqs {
			out[i] = q.Output()
			if q.FinishReason() != FinishStop || q.NumOutputTokens() != 20+i {
				t.Errorf("seq %d: %q after %d tokens", i, q.FinishReason(), q.NumOutputTokens())
			}
			if last := out[i][len(out[i])-1]; last != TokenIMEnd {
				t.Errorf("seq %d ends with token %d, want the end-of-sequence token", i, last)
			}
		}
		return out
	}
	a, b := run(0), run(5)
	for i := range a {
		if !slices.Equal(a[i], b[i]) {
			t.Errorf("sequence %d output changed with the batch around it", i)
		}
	}
}

func TestEngineConfigValidateReportsEveryProblem(t *testing.T) {
	err := EngineConfig{SchedulingPolicy: "lifo", NumGPUBlocks: 1, LongPrefillTokenThreshold: -1}.Validate()
	if err == nil {
		t.Fatal("Validate accepted a zero config")
	}
	for _, want := range []string{"max-num-seqs", "max-model-len", "block-size", "num-gpu-blocks",
		"scheduling-policy", "max-num-batched-tokens", "long-prefill-token-threshold",
		"prefill-tokens-per-second", "decode-step-base"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not mention %s:\n%v", want, err)
		}
	}
	if err := DefaultEngineConfig().Validate(); err != nil {
		t.Errorf("defaults invalid: %v", err)
	}
	c := DefaultEngineConfig()
	c.MaxModelLen = c.NumGPUBlocks * c.BlockSize
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "larger than the KV cache") {
		t.Errorf("max-model-len over KV capacity: %v", err)
	}
}
