package system

// fairness_bench_test.go: `make bench-fairness` (issue 12, "Fairness";
// docs/traffic.md "Measured: fairness between agent teams").

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

const (
	fairEngines = 2
	fairSlots   = 4 // max_num_seqs and max_concurrency per engine
	fairProxies = 3
	fairOutput  = 100 // tokens per answer (IgnoreEOS: exactly)
)

// fairCost is the VTC cost of one answer (admission.Cost: prompt + 2 ×
// completion tokens), from the engine's usage.
func fairCost(prompt, completion int64) float64 { return float64(prompt) + 2*float64(completion) }

// BenchmarkAgentFairness is issue 12's fairness scenario on real binaries:
// a control plane, 3 proxies sharing Redis and NATS, 2 vllm-sim engines
// (max_num_seqs 4, max_concurrency 4 each) of one model group, and two
// agent teams (two orgs' agent keys) both backlogged for the window: team
// "big" runs 10× the closed loops of team "small" with prompts 4× longer,
// every loop spread over the proxies. It reports the served token cost of
// each team (prompt + 2 × completion tokens from the engines' usage, by
// answer completion time within the window), their ratio, the Jain index,
// and how busy the engines were (mean slot occupancy, sampled from the
// engines every 5 ms, and the share of samples with every slot taken), and
// fails unless the ratio is within 1.25 and the mean occupancy at least
// 95% (the bounds).
//
// Scaled by SLUICE_BENCH_WINDOW (60s) and SLUICE_BENCH_SMALL_LOOPS (16; the
// big team runs 10×).
func BenchmarkAgentFairness(b *testing.B) {
	window := envDuration("SLUICE_BENCH_WINDOW", 60*time.Second)
	smallLoops := envInt("SLUICE_BENCH_SMALL_LOOPS", 16)
	bigLoops := 10 * smallLoops

	d := startDist(b)
	ctx := context.Background()
	var proxies []*proxy
	for range fairProxies {
		// Started before the orgs exist: their creation bootstraps the
		// limits epoch (no startup quarantine of their scopes).
		// The agent queue's timeout is above the window: the big team's
		// loops wait longer than the default minute for their share, and
		// the scenario is about the share, not shedding.
		proxies = append(proxies, d.StartProxy("default", time.Minute, func(c *dataplane.Config) {
			c.LimitsCallTimeout, c.AdmissionQueues = 2*time.Second, "agent=1024/5m0s"
		}))
	}
	var sims []*vllmsim.Server
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "fair", PlatformWide: true}))
	require.NoError(b, err)
	for range fairEngines {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr, cfg.TimeScale, cfg.IgnoreEOS, cfg.MaxNumSeqs = "127.0.0.1:0", 1, true, fairSlots
		s := harness.StartSim(b, cfg)
		sims = append(sims, s)
		_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "fair", ApiBase: s.URL() + "/v1",
			UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: fairSlots,
			Prices: &adminv1.Prices{InputPerToken: 1e-9, OutputPerToken: 3e-9}}))
		require.NoError(b, err)
	}
	agentKey := func(name string) string {
		ten := d.NewTenant(name)
		k, err := d.Clients().Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID,
			TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT}))
		require.NoError(b, err)
		return k.Msg.Token
	}
	bigTok, smallTok := agentKey("fair-big"), agentKey("fair-small")
	for _, p := range proxies {
		harness.Eventually(b, func() bool { return len(p.DP.Catalog().Deployments("fair")) == fairEngines }, 15*time.Second, 10*time.Millisecond)
		harness.WaitStatus(b, p, bigTok, http.StatusOK, 15*time.Second)
		harness.WaitStatus(b, p, smallTok, http.StatusOK, 15*time.Second)
	}

	body := func(words int) string {
		return fmt.Sprintf(`{"model":"fair","max_tokens":%d,"messages":[{"role":"user","content":"%s"}]}`, fairOutput, strings.Repeat("lorem ", words))
	}
	type served struct {
		team string
		cost float64
		at   time.Time
	}
	var mu sync.Mutex
	var done []served
	var from, to atomic.Int64 // the window, unix ns (0: not started)
	var failed atomic.Int64   // non-200 answers inside the window
	lctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	loop := func(url, tok, team, b string) {
		defer wg.Done()
		for lctx.Err() == nil {
			req, _ := http.NewRequestWithContext(lctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(b))
			req.Header.Set("Authorization", "Bearer "+tok)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				continue
			}
			var out struct {
				Usage struct {
					PromptTokens     int64 `json:"prompt_tokens"`
					CompletionTokens int64 `json:"completion_tokens"`
				} `json:"usage"`
			}
			err = json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			now := time.Now()
			if err != nil || resp.StatusCode != http.StatusOK {
				if f := from.Load(); f != 0 && now.UnixNano() > f && now.UnixNano() < to.Load() && lctx.Err() == nil {
					failed.Add(1)
				}
				time.Sleep(20 * time.Millisecond) // a new deployment's quarantine (limits_recovering) in the warm-up
				continue
			}
			mu.Lock()
			done = append(done, served{team, fairCost(out.Usage.PromptTokens, out.Usage.CompletionTokens), now})
			mu.Unlock()
		}
	}
	for i := range bigLoops {
		wg.Add(1)
		go loop(proxies[i%fairProxies].URL, bigTok, "big", body(800))
	}
	for i := range smallLoops {
		wg.Add(1)
		go loop(proxies[i%fairProxies].URL, smallTok, "small", body(200))
	}
	defer func() { cancel(); wg.Wait() }()

	// Backlogged: every proxy has agents of both teams waiting (the
	// small team's loops exceed its fair share of the 8 slots).
	queued := func(p *proxy) int64 {
		resp, err := http.Get(p.URL + "/health/backlog")
		require.NoError(b, err)
		defer resp.Body.Close()
		var bl struct {
			Classes map[string]struct {
				Queued int64 `json:"queued"`
			} `json:"classes"`
		}
		require.NoError(b, json.NewDecoder(resp.Body).Decode(&bl))
		return bl.Classes["agent"].Queued
	}
	harness.Eventually(b, func() bool {
		for _, p := range proxies {
			if queued(p) < int64(bigLoops/fairProxies/2) {
				return false
			}
		}
		return true
	}, 60*time.Second, 20*time.Millisecond, "every proxy's agent queue backlogged")
	b.ResetTimer()
	start := time.Now().Add(3 * time.Second) // the counters settle after the start
	end := start.Add(window)
	from.Store(start.UnixNano())
	to.Store(end.UnixNano())
	var samples, full int
	var occupied, minQueued float64
	minQueued = -1
	for time.Now().Before(end) {
		if time.Now().After(start) {
			samples++
			running := 0
			for _, s := range sims {
				running += s.Stats().NumRunning
			}
			occupied += float64(running) / float64(fairEngines*fairSlots)
			if running == fairEngines*fairSlots {
				full++
			}
			if samples%200 == 0 { // about every second: still backlogged?
				q := 0.0
				for _, p := range proxies {
					q += float64(queued(p))
				}
				if minQueued < 0 || q < minQueued {
					minQueued = q
				}
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	b.StopTimer()
	cancel()
	wg.Wait()

	cost := map[string]float64{}
	n := map[string]int{}
	for _, s := range done {
		if s.at.After(start) && s.at.Before(end) {
			cost[s.team] += s.cost
			n[s.team]++
		}
	}
	x, y := cost["big"], cost["small"]
	require.Positive(b, x)
	require.Positive(b, y)
	ratio := max(x, y) / min(x, y)
	jain := (x + y) * (x + y) / (2 * (x*x + y*y))
	occupancy := occupied / float64(samples)
	allBusy := float64(full) / float64(samples)
	b.Logf("fairness: %d engines × %d slots, %d proxies; team big %d loops (800-word prompts), team small %d loops (200-word prompts), %d-token answers; window %s",
		fairEngines, fairSlots, fairProxies, bigLoops, smallLoops, fairOutput, window)
	b.Logf("served cost (prompt + 2 × completion tokens): big %.0f (%d requests), small %.0f (%d requests): ratio %.3f, Jain index %.4f",
		x, n["big"], y, n["small"], ratio, jain)
	b.Logf("engines: mean slot occupancy %.1f%%, every slot taken in %.1f%% of %d samples; fewest agents queued over the proxies %.0f; non-200 answers in the window %d",
		100*occupancy, 100*allBusy, samples, minQueued, failed.Load())
	b.ReportMetric(ratio, "cost-ratio")
	b.ReportMetric(jain, "jain")
	b.ReportMetric(100*occupancy, "occupancy-%")
	if ratio > 1.25 {
		b.Errorf("served cost ratio %.3f above 1.25", ratio)
	}
	if occupancy < 0.95 {
		b.Errorf("engines %.1f%% busy, below 95%%", 100*occupancy)
	}
	if minQueued <= 0 {
		b.Errorf("the agent queues emptied during the window: the teams were not backlogged")
	}
	if failed.Load() > 0 {
		b.Errorf("%d requests refused or failed in the window", failed.Load())
	}
}
