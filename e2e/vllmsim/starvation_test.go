package vllmsim

import (
	"slices"
	"testing"
	"time"
)

// The effect Sluice exists to fix, reproduced on the scheduler alone: one
// engine with max-num-seqs 8 and a dozen agent loops (20k-token
// conversations, 200 to 400 output tokens, a 200-token tool result and
// 200 ms of tool time per turn). Chat requests (300-token prompts, 200
// output tokens) arrive every 10 s from 30 s on. Under fcfs a chat waits
// behind the agents queued before it; under priority it goes to the head of
// the queue but still waits for a running agent to finish, because nothing
// running is ever preempted for it.
const (
	agentLoops       = 12
	agentPrompt      = 20000
	agentShared      = 2000 // system prompt and tools, shared by every agent
	agentOutputMin   = 200
	agentOutputSpan  = 200
	agentToolResult  = 200
	agentToolLatency = 200 * time.Millisecond
	chatPrompt       = 300
	chatOutput       = 200
	chatFirst        = 30 * time.Second
	chatEvery        = 10 * time.Second
	chatProbes       = 7
)

// starvationConfig is the engine of the scenario: the defaults with
// max-num-seqs 8.
func starvationConfig(policy Policy) EngineConfig {
	c := DefaultEngineConfig()
	c.MaxNumSeqs = 8
	c.SchedulingPolicy = policy
	return c
}

type starvationResult struct {
	idleTTFT    time.Duration
	chatTTFT    []time.Duration // one per probe, in arrival order
	chatQueued  []time.Duration
	agentTurns  int
	stats       Stats
	medianRatio float64
	minRatio    float64
}

func agentOutput(agent, turn int) int {
	return agentOutputMin + int(mix64(uint64(agent)<<32|uint64(turn))%uint64(agentOutputSpan+1))
}

func runStarvation(tb testing.TB, policy Policy) starvationResult {
	tb.Helper()
	chatPriority, agentPriority := 0, 0
	if policy == PolicyPriority {
		chatPriority, agentPriority = -10, 10
	}
	chatSpec := func(i int) SequenceSpec {
		return SequenceSpec{ID: "chat", Prompt: ids(50_000_000+1000*i, chatPrompt), MaxTokens: chatOutput,
			Priority: chatPriority, Seed: uint64(i), Arrival: chatFirst + time.Duration(i)*chatEvery}
	}
	var res starvationResult

	idle, err := NewScheduler(starvationConfig(policy))
	if err != nil {
		tb.Fatal(err)
	}
	spec := chatSpec(0)
	spec.Arrival = 0
	ic, err := idle.Add(spec)
	if err != nil {
		tb.Fatal(err)
	}
	for !idle.Idle() {
		idle.Step()
	}
	res.idleTTFT, _ = ic.TimeToFirstToken()

	s, err := NewScheduler(starvationConfig(policy))
	if err != nil {
		tb.Fatal(err)
	}
	type turn struct {
		agent, n int
		prompt   []TokenID
	}
	turns := map[*Sequence]turn{}
	addTurn := func(t turn, at time.Duration) {
		q, err := s.Add(SequenceSpec{ID: "agent", Prompt: t.prompt, MaxTokens: agentOutput(t.agent, t.n),
			Priority: agentPriority, Arrival: at, Seed: uint64(t.agent)<<32 | uint64(t.n)})
		if err != nil {
			tb.Fatal(err)
		}
		turns[q] = t
	}
	shared := ids(1, agentShared)
	for a := range agentLoops {
		p := append(slices.Clone(shared), ids(100_000*(a+1), agentPrompt-agentShared)...)
		addTurn(turn{agent: a, prompt: p}, time.Duration(a)*300*time.Millisecond)
	}
	var chats []*Sequence
	for i := range chatProbes {
		q, err := s.Add(chatSpec(i))
		if err != nil {
			tb.Fatal(err)
		}
		chats = append(chats, q)
	}
	for chats[len(chats)-1].Status() != StatusFinished {
		for _, f := range s.Step().Finished {
			t, ok := turns[f.Seq]
			if !ok {
				continue // a chat
			}
			delete(turns, f.Seq)
			res.agentTurns++
			next := append(slices.Clip(t.prompt), f.Seq.Output()...)
			next = append(next, ids(200_000_000+1000*res.agentTurns, agentToolResult)...)
			addTurn(turn{agent: t.agent, n: t.n + 1, prompt: next}, s.Now()+agentToolLatency)
		}
	}
	var ratios []float64
	for _, q := range chats {
		ttft, _ := q.TimeToFirstToken()
		queued, _ := q.QueueTime()
		res.chatTTFT = append(res.chatTTFT, ttft)
		res.chatQueued = append(res.chatQueued, queued)
		ratios = append(ratios, float64(ttft)/float64(res.idleTTFT))
	}
	slices.Sort(ratios)
	res.medianRatio, res.minRatio = ratios[len(ratios)/2], ratios[0]
	res.stats = s.Stats()
	return res
}

func TestAgentsStarveChatTTFT(t *testing.T) {
	for _, policy := range []Policy{PolicyFCFS, PolicyPriority} {
		t.Run(string(policy), func(t *testing.T) {
			r := runStarvation(t, policy)
			t.Logf("%s: chat TTFT idle %v; with %d agent loops %v (queued %v): median %.0fx, min %.0fx; %d agent turns, %d preemptions, prefix cache hits %.0f%%",
				policy, r.idleTTFT, agentLoops, r.chatTTFT, r.chatQueued, r.medianRatio, r.minRatio, r.agentTurns,
				r.stats.NumPreemptions, 100*float64(r.stats.PrefixCacheHits)/float64(r.stats.PrefixCacheQueries))
			// Idle: one step of 10 ms + 0.1 ms + 300 tokens at 10k tokens/s.
			if want := 10*time.Millisecond + 100*time.Microsecond + 30*time.Millisecond; r.idleTTFT != want {
				t.Errorf("idle TTFT = %v, want %v", r.idleTTFT, want)
			}
			if r.stats.PrefixCacheHits == 0 {
				t.Error("agent turns never hit the prefix cache")
			}
			switch policy {
			case PolicyFCFS:
				if r.minRatio < 10 {
					t.Errorf("a chat's TTFT was only %.1fx the idle engine's, want >= 10x for every probe", r.minRatio)
				}
			case PolicyPriority:
				// Priority only reorders the waiting queue: every chat still
				// waits for a running agent to finish.
				for i, q := range r.chatQueued {
					if q <= 0 {
						t.Errorf("chat %d was admitted without waiting for a slot", i)
					}
				}
				if r.medianRatio < 2 {
					t.Errorf("median chat TTFT only %.1fx the idle engine's", r.medianRatio)
				}
			}
		})
	}
}
