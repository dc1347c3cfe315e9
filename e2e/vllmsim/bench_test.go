package vllmsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkScenario200Streams60s is the simulator's speed test: 200 clients
// keep one streaming chat request each in flight against a default engine
// (max-num-seqs 256) for 60 simulated seconds, over real HTTP on loopback.
// One iteration is the whole scenario, so ns/op is its wall time; it also
// reports the simulated seconds the engine covered, the requests completed,
// the tokens streamed and the process CPU per completed request (the
// in-process clients included, so the simulator's own share is lower).
//
//	go test -run '^$' -bench Scenario200Streams -benchtime 1x ./e2e/vllmsim/
func BenchmarkScenario200Streams60s(b *testing.B) {
	for _, scale := range []float64{10, 20} {
		b.Run(fmt.Sprintf("timescale=%g", scale), func(b *testing.B) {
			var sum streamScenario
			for range b.N {
				r := runStreamScenario(b, scale, 200, 60*time.Second)
				sum.add(r)
			}
			n := float64(b.N)
			b.ReportMetric(sum.wall.Seconds()/n, "wall-s")
			b.ReportMetric(sum.simulated.Seconds()/n, "sim-s")
			b.ReportMetric(float64(sum.completed)/n, "requests")
			b.ReportMetric(float64(sum.tokens)/n, "tokens")
			b.ReportMetric(float64(sum.cpu.Milliseconds())/float64(max(sum.completed, 1)), "cpu-ms/req")
			b.ReportMetric(sum.cpu.Seconds()/n, "cpu-s")
			if sum.errors > 0 {
				b.Errorf("%d requests failed", sum.errors)
			}
		})
	}
}

type streamScenario struct {
	wall, simulated, cpu time.Duration
	completed, tokens    int64
	errors               int64
}

func (s *streamScenario) add(o streamScenario) {
	s.wall += o.wall
	s.simulated += o.simulated
	s.cpu += o.cpu
	s.completed += o.completed
	s.tokens += o.tokens
	s.errors += o.errors
}

func runStreamScenario(b *testing.B, scale float64, streams int, simulated time.Duration) streamScenario {
	b.Helper()
	b.StopTimer()
	s := startSim(b, func(c *Config) {
		c.TimeScale = scale
		c.Seed = 1
	})
	system := FillerText(1, 400)
	users := make([]string, streams)
	for i := range users {
		users[i] = FillerText(uint64(1000+i), 200)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var completed, tokens, failed atomic.Int64
	var wg sync.WaitGroup
	simStart := s.Stats().Now
	cpu0, wall0 := processCPU(), time.Now()
	b.StartTimer()
	for i := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for turn := 0; ctx.Err() == nil; turn++ {
				body := map[string]any{
					"messages": []map[string]string{
						{"role": "system", "content": system},
						{"role": "user", "content": fmt.Sprintf("%s (%d)", users[i], turn)},
					},
					"max_tokens":     512,
					"stream":         true,
					"stream_options": map[string]bool{"include_usage": true},
				}
				resp, err := s.post(ctx, "/v1/chat/completions", body)
				if err != nil {
					if ctx.Err() == nil {
						failed.Add(1)
					}
					return
				}
				n, ok := drainStream(resp.Body)
				resp.Body.Close()
				switch {
				case ok:
					completed.Add(1)
					tokens.Add(int64(n))
				case ctx.Err() == nil:
					failed.Add(1)
					return
				}
			}
		}()
	}
	for s.Stats().Now-simStart < simulated {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	b.StopTimer()
	r := streamScenario{
		wall:      time.Since(wall0),
		simulated: s.Stats().Now - simStart,
		cpu:       processCPU() - cpu0,
		completed: completed.Load(),
		tokens:    tokens.Load(),
		errors:    failed.Load(),
	}
	b.Logf("time scale %g: %v simulated in %v of wall time; %d requests, %d tokens streamed; CPU %v (%.1f ms per request)",
		scale, r.simulated.Round(time.Millisecond), r.wall.Round(time.Millisecond), r.completed, r.tokens,
		r.cpu.Round(time.Millisecond), float64(r.cpu.Microseconds())/1000/float64(max(r.completed, 1)))
	b.StartTimer()
	return r
}

// drainStream reads an SSE stream to its end and returns the completion
// tokens of its usage chunk, and whether it ended with [DONE].
func drainStream(r io.Reader) (int, bool) {
	br := bufio.NewReaderSize(r, 64<<10)
	tokens := 0
	for {
		line, err := br.ReadSlice('\n')
		if bytes.HasPrefix(line, []byte("data: [DONE]")) {
			return tokens, true
		}
		if bytes.Contains(line, []byte(`"choices":[],"usage"`)) {
			var c chunk
			if json.Unmarshal(bytes.TrimPrefix(bytes.TrimSpace(line), []byte("data: ")), &c) == nil && c.Usage != nil {
				tokens = c.Usage.CompletionTokens
			}
		}
		if err != nil {
			return tokens, false
		}
	}
}

// BenchmarkSchedulerStep measures one engine step of a full default engine:
// 256 running sequences decoding, finished ones replaced by new 1000-token
// prompts sharing a 500-token prefix.
func BenchmarkSchedulerStep(b *testing.B) {
	s, err := NewScheduler(DefaultEngineConfig())
	if err != nil {
		b.Fatal(err)
	}
	shared := ids(1, 500)
	n := 0
	add := func() {
		p := append(append([]TokenID{}, shared...), ids(1_000_000+1000*n, 500)...)
		n++
		if _, err := s.Add(SequenceSpec{ID: "q", Prompt: p, MaxTokens: 256, StopAfter: 64 + n%192,
			Seed: uint64(n), Arrival: s.Now()}); err != nil {
			b.Fatal(err)
		}
	}
	for range DefaultMaxNumSeqs {
		add()
	}
	for range 20 {
		s.Step()
	}
	b.ReportAllocs()
	b.ResetTimer()
	tokens := 0
	for range b.N {
		r := s.Step()
		tokens += len(r.Tokens)
		for range r.Finished {
			add()
		}
	}
	b.ReportMetric(float64(tokens)/float64(b.N), "tokens/step")
}

// BenchmarkAgentsStarveChatHTTP reproduces, over HTTP, the effect Sluice
// exists to fix (TestAgentsStarveChatTTFT is the exact, scheduler-level
// version): on an engine with max-num-seqs 8, twelve agent loops
// (20k-token conversations, 200-400-token answers, a 200-token tool result
// per turn) make 300-token chats wait. It reports the median time to first
// token of chats sent every 10 simulated seconds from 30 s on, and of chats
// on the idle engine, in simulated milliseconds (wall time × time scale, so
// HTTP overhead inflates the idle figure a little), and their ratio.
//
//	go test -run '^$' -bench AgentsStarveChatHTTP -benchtime 1x ./e2e/vllmsim/
func BenchmarkAgentsStarveChatHTTP(b *testing.B) {
	const scale = 10
	for _, policy := range []Policy{PolicyFCFS, PolicyPriority} {
		b.Run(string(policy), func(b *testing.B) {
			var idle, loaded time.Duration
			for range b.N {
				i, l := runAgentsStarveChat(b, policy, scale)
				idle += i
				loaded += l
			}
			b.ReportMetric(float64(idle.Milliseconds())/float64(b.N), "idle-ttft-ms")
			b.ReportMetric(float64(loaded.Milliseconds())/float64(b.N), "loaded-ttft-ms")
			b.ReportMetric(float64(loaded)/float64(idle), "ratio")
		})
	}
}

func median(ds []time.Duration) time.Duration {
	ds = slices.Clone(ds)
	slices.Sort(ds)
	return ds[len(ds)/2]
}

func runAgentsStarveChat(b *testing.B, policy Policy, scale float64) (idle, loaded time.Duration) {
	b.Helper()
	cfg := func(c *Config) {
		c.EngineConfig = starvationConfig(policy)
		c.TimeScale = scale
	}
	var chatHeader, agentHeader []string
	if policy == PolicyPriority {
		chatHeader = []string{"X-Vllm-Priority: -10"}
		agentHeader = []string{"X-Vllm-Priority: 10"}
	}
	chat := func(s *sim, i int) time.Duration {
		body := chatBody(FillerText(uint64(7+i), chatPrompt-10), map[string]any{"max_tokens": chatOutput,
			"ignore_eos": true, "stream": true})
		start := time.Now()
		resp, err := s.post(context.Background(), "/v1/chat/completions", body, chatHeader...)
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for {
			line, err := br.ReadBytes('\n')
			if err != nil {
				b.Fatalf("chat stream: %v", err)
			}
			if bytes.Contains(line, []byte(`"content":"`)) && !bytes.Contains(line, []byte(`"role"`)) {
				ttft := time.Duration(float64(time.Since(start)) * scale)
				_, _ = io.Copy(io.Discard, resp.Body)
				return ttft
			}
		}
	}

	idleSim := startSim(b, cfg)
	var idles []time.Duration
	for i := range 5 {
		idles = append(idles, chat(idleSim, i))
	}
	idle = median(idles)

	s := startSim(b, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	system := FillerText(1, agentShared)
	for a := range agentLoops {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(float64(a) * float64(300*time.Millisecond) / scale))
			msgs := []map[string]string{
				{"role": "system", "content": system},
				{"role": "user", "content": FillerText(uint64(100+a), agentPrompt-agentShared)},
			}
			for turn := 0; ctx.Err() == nil; turn++ {
				var r chatResponse
				resp, err := s.post(ctx, "/v1/chat/completions", map[string]any{"messages": msgs,
					"max_tokens": agentOutput(a, turn), "ignore_eos": true}, agentHeader...)
				if err != nil {
					return
				}
				err = json.NewDecoder(resp.Body).Decode(&r)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusOK || len(r.Choices) == 0 {
					return
				}
				msgs = append(msgs,
					map[string]string{"role": "assistant", "content": r.Choices[0].Message.Content},
					map[string]string{"role": "user", "content": FillerText(uint64(10_000*a+turn), agentToolResult)})
				time.Sleep(time.Duration(float64(agentToolLatency) / scale))
			}
		}()
	}
	var ttfts []time.Duration
	for i := range chatProbes {
		for s.Stats().Now < chatFirst+time.Duration(i)*chatEvery {
			time.Sleep(2 * time.Millisecond)
		}
		ttfts = append(ttfts, chat(s, 100+i))
	}
	loaded = median(ttfts)
	cancel()
	wg.Wait()
	st := s.Stats()
	b.Logf("%s: chat TTFT idle %v (median of %v), loaded %v (median of %v): %.0fx; %d preemptions",
		policy, idle.Round(time.Millisecond), idles, loaded.Round(time.Millisecond), ttfts,
		float64(loaded)/float64(idle), st.NumPreemptions)
	return idle, loaded
}
