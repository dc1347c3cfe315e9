package system

// humans_bench_test.go: `make bench-humans-agents` (issue 12, docs/traffic.md
// "Measured"): people and coding agents on one shared pool of two simulated
// engines behind three proxies.

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/load"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// The shared-fleet scenario of issue 12.
const (
	haEngines        = 2
	haMaxNumSeqs     = 8
	haBatchedTokens  = 8192
	haReserve        = 2  // interactive_reserve per deployment
	haAgentPriority  = 10 // the agent class's default engine priority
	haAgentPrompt    = 20_000
	haAgentGrowth    = 500 // tokens of tool output appended each turn
	haAgentOutput    = 300
	haAgentMaxPrompt = 29_000 // a conversation past this starts over (max_model_len 32768)
	haChatPrompt     = 300
	haChatOutput     = 100
	haChatEvery      = 500 * time.Millisecond
	// haPrefillCap is the max_prefill_tokens_in_flight of the capped
	// phase: half a step's token budget (about 400 ms of prefill at 10k
	// tokens/s).
	haPrefillCap = haBatchedTokens / 2
	// haIsolation is the group's prefill_isolation of the isolated phase:
	// one of the two deployments kept free of agent prefill.
	haIsolation = 1
)

func envDuration(name string, def time.Duration) time.Duration {
	if v := os.Getenv(name); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
	}
	return def
}

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
	}
	return def
}

// haEngine is a simulated engine behind a probe that counts the agent
// requests (engine priority haAgentPriority) in flight at it.
type haEngine struct {
	sim *vllmsim.Server
	srv *httptest.Server
}

// haFleet counts agent requests in flight over every engine, and the peak.
type haFleet struct {
	agents, peak atomic.Int64
}

func (f *haFleet) probe(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		var p struct {
			Priority *int `json:"priority"`
		}
		_ = json.Unmarshal(body, &p)
		if p.Priority != nil && *p.Priority == haAgentPriority {
			n := f.agents.Add(1)
			for {
				pk := f.peak.Load()
				if n <= pk || f.peak.CompareAndSwap(pk, n) {
					break
				}
			}
			defer f.agents.Add(-1)
		}
		next.ServeHTTP(w, r)
	})
}

func startHAEngine(b *testing.B, f *haFleet, seed uint64) *haEngine {
	cfg := vllmsim.DefaultConfig()
	cfg.Addr = "127.0.0.1:0"
	cfg.MaxNumSeqs, cfg.MaxNumBatchedTokens = haMaxNumSeqs, haBatchedTokens
	cfg.SchedulingPolicy = vllmsim.PolicyPriority
	cfg.IgnoreEOS = true // every answer is exactly its max_tokens
	cfg.Seed = seed
	sim, err := vllmsim.New(cfg, slog.New(slog.DiscardHandler))
	require.NoError(b, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sim.RunEngine(ctx) }()
	srv := httptest.NewServer(f.probe(sim.Handler()))
	b.Cleanup(func() { srv.CloseClientConnections(); cancel(); <-done; srv.Close() })
	return &haEngine{sim: sim, srv: srv}
}

// haTokens counts output tokens by the wall time their chunk arrived.
type haTokens struct {
	mu       sync.Mutex
	from, to time.Time
	tokens   float64
}

// add counts one finished (or cut) stream: n completion tokens spread
// evenly over its chunks' arrival times.
func (c *haTokens) add(chunks []time.Time, n int) {
	if len(chunks) == 0 {
		return
	}
	per := float64(n) / float64(len(chunks))
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, t := range chunks {
		if !t.Before(c.from) && t.Before(c.to) {
			c.tokens += per
		}
	}
}

func (c *haTokens) perSecond() float64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.tokens / c.to.Sub(c.from).Seconds()
}

// haAgentLoop is the scenario's agent loop.
var haAgentLoop = load.Agent{Model: "shared", Prompt: haAgentPrompt, Growth: haAgentGrowth, Output: haAgentOutput, MaxPrompt: haAgentMaxPrompt}

func haChat(url, tok string, seed uint64) (time.Duration, int, bool) {
	return load.Chat(url, tok, "shared", seed, haChatPrompt, haChatOutput)
}

// haChats runs a chat probe every haChatEvery through the proxies in turn
// until stop, and returns the TTFTs and the refused or failed probes.
func haChats(urls []string, tok string, seed uint64, stop <-chan struct{}) (ttfts []time.Duration, failed []int) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	tick := time.NewTicker(haChatEvery)
	defer tick.Stop()
	for i := 0; ; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, status, ok := haChat(urls[i%len(urls)], tok, seed+uint64(i))
			mu.Lock()
			defer mu.Unlock()
			if ok {
				ttfts = append(ttfts, d)
			} else {
				failed = append(failed, status)
			}
		}()
		select {
		case <-stop:
			wg.Wait()
			return ttfts, failed
		case <-tick.C:
		}
	}
}

// haLoad is one load phase's figures.
type haLoad struct {
	agentTokensPerSec float64
	agentErrors       int64
	ttfts             []time.Duration
	chatFailed        []int
	peakAgents        int64
}

// BenchmarkHumansAgents is `make bench-humans-agents`: 2 engines
// (max_num_seqs 8, max_num_batched_tokens 8192, priority scheduling, one
// model group "shared", max_concurrency 8 and an interactive reserve of 2
// each), 3 proxies, 12 multi-turn agent loops (20k-token prompts growing
// each turn, 300-token streamed answers) and a chat probe (300-token
// prompt, 100-token streamed answer) every 0.5 s. One run measures, on the
// same engines: chat TTFT idle; agents alone (their key classed
// interactive, i.e. no class at all: every slot, no priority); agents and
// chats with classes (agent key classed agent); and agents and chats with
// classes disabled (the agents' key classed interactive). Each load phase
// warms up (agents start staggered and prefill their first 20k tokens)
// before its measured window.
//
// Scaled by SLUICE_BENCH_AGENTS (12), SLUICE_BENCH_WARMUP (30s),
// SLUICE_BENCH_WINDOW (30s) and SLUICE_BENCH_IDLE (10s).
func BenchmarkHumansAgents(b *testing.B) {
	agents := envInt("SLUICE_BENCH_AGENTS", 12)
	warmup := envDuration("SLUICE_BENCH_WARMUP", 30*time.Second)
	window := envDuration("SLUICE_BENCH_WINDOW", 30*time.Second)
	idle := envDuration("SLUICE_BENCH_IDLE", 10*time.Second)

	d := startDist(b)
	ctx := context.Background()
	fleet := &haFleet{}
	var engines []*haEngine
	for i := range haEngines {
		engines = append(engines, startHAEngine(b, fleet, uint64(i+1)))
	}
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "shared", PlatformWide: true}))
	require.NoError(b, err)
	tr := adminv1connect.NewTrafficServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	var depIDs []string
	for _, e := range engines {
		dep, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "shared", ApiBase: e.srv.URL + "/v1",
			UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: haMaxNumSeqs,
			Prices: &adminv1.Prices{InputPerToken: 1e-7, OutputPerToken: 3e-7}}))
		require.NoError(b, err)
		depIDs = append(depIDs, dep.Msg.Deployment.Id)
		_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: dep.Msg.Deployment.Id,
			Traffic: &adminv1.DeploymentTraffic{InteractiveReserve: haReserve, PriorityScheduling: true}}))
		require.NoError(b, err)
	}
	ten := d.NewTenant("humans")
	key := func(class adminv1.TrafficClass) string {
		k, err := d.Clients().Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID, TrafficClass: class}))
		require.NoError(b, err)
		return k.Msg.Token
	}
	chatTok := key(adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE)
	agentTok := key(adminv1.TrafficClass_TRAFFIC_CLASS_AGENT)
	unclassedTok := key(adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE) // "classes disabled": everyone interactive
	var urls []string
	var proxies []*proxy
	for range 3 {
		p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.LimitsCallTimeout = 2 * time.Second })
		harness.Eventually(b, func() bool {
			ds := p.DP.Catalog().Deployments("shared")
			return len(ds) == haEngines && ds[0].GetTraffic().GetInteractiveReserve() == haReserve && ds[1].GetTraffic().GetInteractiveReserve() == haReserve
		}, 15*time.Second, 10*time.Millisecond)
		for _, tok := range []string{chatTok, agentTok, unclassedTok} {
			harness.WaitStatus(b, p, tok, http.StatusOK, 15*time.Second)
		}
		urls = append(urls, p.URL)
		proxies = append(proxies, p)
	}
	// New deployments' lease counts are in quarantine for their first
	// moments (limits_recovering): wait until a chat passes on every proxy.
	harness.Eventually(b, func() bool {
		for i, u := range urls {
			if _, _, ok := haChat(u, chatTok, uint64(900+i)); !ok {
				return false
			}
		}
		return true
	}, 30*time.Second, 100*time.Millisecond)
	quiet := func() {
		harness.Eventually(b, func() bool {
			for _, e := range engines {
				if st := e.sim.Stats(); st.NumRunning+st.NumWaiting > 0 {
					return false
				}
			}
			return fleet.agents.Load() == 0
		}, time.Minute, 50*time.Millisecond)
	}

	b.ResetTimer()
	// Phase 1: chats alone.
	stop := make(chan struct{})
	time.AfterFunc(idle, func() { close(stop) })
	idleTTFT, idleFailed := haChats(urls, chatTok, 1_000_000, stop)
	require.NotEmpty(b, idleTTFT)

	phase := 0
	load := func(agentKey string, withChats bool) haLoad {
		phase++
		quiet()
		ctx, cancel := context.WithCancel(context.Background())
		toks := &haTokens{}
		start := time.Now()
		toks.from, toks.to = start.Add(warmup), start.Add(warmup+window)
		var errs atomic.Int64
		var wg sync.WaitGroup
		for i := range agents {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Agents start staggered over the first third of the warm-up.
				select {
				case <-time.After(warmup / 3 * time.Duration(i) / time.Duration(agents)):
				case <-ctx.Done():
					return
				}
				haAgentLoop.Run(ctx, urls[i%len(urls)], agentKey, fmt.Sprintf("p%d-agent%d", phase, i), uint64(phase*10_000_000+i*100_000), toks.add, &errs)
			}()
		}
		time.Sleep(time.Until(toks.from))
		fleet.peak.Store(fleet.agents.Load())
		var out haLoad
		stop := make(chan struct{})
		chatsDone := make(chan struct{})
		if withChats {
			go func() {
				defer close(chatsDone)
				out.ttfts, out.chatFailed = haChats(urls, chatTok, uint64(phase*10_000_000+9_000_000), stop)
			}()
		} else {
			close(chatsDone)
		}
		time.Sleep(time.Until(toks.to))
		out.peakAgents = fleet.peak.Load()
		close(stop)
		<-chatsDone
		cancel()
		wg.Wait()
		out.agentTokensPerSec = toks.perSecond()
		out.agentErrors = errs.Load()
		return out
	}
	alone := load(unclassedTok, false)
	on := load(agentTok, true)
	off := load(unclassedTok, true)
	// With classes and the prefill cap, on the same engines.
	b.StopTimer()
	for _, dep := range depIDs {
		_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: dep,
			Traffic: &adminv1.DeploymentTraffic{InteractiveReserve: haReserve, PriorityScheduling: true, MaxPrefillTokensInFlight: haPrefillCap}}))
		require.NoError(b, err)
	}
	for _, px := range proxies {
		harness.Eventually(b, func() bool {
			for _, dd := range px.DP.Catalog().Deployments("shared") {
				if dd.GetTraffic().GetMaxPrefillTokensInFlight() != haPrefillCap {
					return false
				}
			}
			return true
		}, 15*time.Second, 10*time.Millisecond)
	}
	b.StartTimer()
	capped := load(agentTok, true)
	b.StopTimer()
	// With classes and prefill isolation (one of the two deployments kept
	// free of agent prefill, the group's prefill_isolation 1), without the
	// prefill cap, on the same engines.
	for _, dep := range depIDs {
		_, err = tr.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: dep,
			Traffic: &adminv1.DeploymentTraffic{InteractiveReserve: haReserve, PriorityScheduling: true}}))
		require.NoError(b, err)
	}
	_, err = tr.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: "shared",
		Traffic: &adminv1.ModelGroupTraffic{PrefillIsolation: haIsolation}}))
	require.NoError(b, err)
	for _, px := range proxies {
		harness.Eventually(b, func() bool {
			cat := px.DP.Catalog()
			for _, dd := range cat.Deployments("shared") {
				if dd.GetTraffic().GetMaxPrefillTokensInFlight() != 0 {
					return false
				}
			}
			return cat.ModelGroup("shared").GetTraffic().GetPrefillIsolation() == haIsolation
		}, 15*time.Second, 10*time.Millisecond)
	}
	preempted := func() (n uint64) {
		for _, e := range engines {
			n += e.sim.Stats().NumPreemptions
		}
		return n
	}
	pre0 := preempted()
	b.StartTimer()
	isolated := load(agentTok, true)
	b.StopTimer()
	isoPreemptions := preempted() - pre0
	quiet()
	// The gates' decisions over the phase, summed over the proxies.
	gate := map[string]float64{}
	for _, px := range proxies {
		resp, err := http.Get(px.URL + "/metrics")
		require.NoError(b, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(b, err)
		for _, line := range strings.Split(string(body), "\n") {
			if !strings.HasPrefix(line, "sluice_proxy_prefill_gate_total{") {
				continue
			}
			labels, val, _ := strings.Cut(strings.TrimPrefix(line, "sluice_proxy_prefill_gate_total"), " ")
			v, _ := strconv.ParseFloat(val, 64)
			gate[labels] += v
		}
	}

	p := func(d []time.Duration, q float64) time.Duration {
		return harness.Percentile(d, q).Round(time.Millisecond)
	}
	idle50, idle99 := p(idleTTFT, 50), p(idleTTFT, 99)
	ratio := func(x, y time.Duration) float64 { return float64(x) / float64(y) }
	var rejected uint64
	for _, px := range proxies {
		resp, err := http.Get(px.URL + "/health/backlog")
		require.NoError(b, err)
		var bl struct {
			Classes map[string]struct {
				Rejected uint64 `json:"rejected"`
			} `json:"classes"`
		}
		require.NoError(b, json.NewDecoder(resp.Body).Decode(&bl))
		resp.Body.Close()
		rejected += bl.Classes["interactive"].Rejected
	}
	agentCap := int64(haEngines * (haMaxNumSeqs - haReserve))
	b.Logf("shared fleet: %d engines (max_num_seqs %d, max_num_batched_tokens %d, interactive_reserve %d), 3 proxies, %d agent loops; warm-up %s, window %s",
		haEngines, haMaxNumSeqs, haBatchedTokens, haReserve, agents, warmup, window)
	b.Logf("chat TTFT idle:                 p50 %s p99 %s (n=%d, failed %v)", idle50, idle99, len(idleTTFT), idleFailed)
	b.Logf("chat TTFT with classes:         p50 %s (%.2fx idle) p99 %s (%.2fx idle) (n=%d, refused or failed %v)",
		p(on.ttfts, 50), ratio(p(on.ttfts, 50), idle50), p(on.ttfts, 99), ratio(p(on.ttfts, 99), idle99), len(on.ttfts), on.chatFailed)
	b.Logf("chat TTFT classes disabled:     p50 %s (%.2fx idle) p99 %s (%.2fx idle) (n=%d, refused or failed %v)",
		p(off.ttfts, 50), ratio(p(off.ttfts, 50), idle50), p(off.ttfts, 99), ratio(p(off.ttfts, 99), idle99), len(off.ttfts), off.chatFailed)
	b.Logf("chat TTFT classes + prefill cap %d: p50 %s (%.2fx idle) p99 %s (%.2fx idle) (n=%d, refused or failed %v)", haPrefillCap,
		p(capped.ttfts, 50), ratio(p(capped.ttfts, 50), idle50), p(capped.ttfts, 99), ratio(p(capped.ttfts, 99), idle99), len(capped.ttfts), capped.chatFailed)
	b.Logf("chat TTFT classes + prefill isolation %d: p50 %s (%.2fx idle) p99 %s (%.2fx idle) (n=%d, refused or failed %v; engine preemptions in the phase %d)", haIsolation,
		p(isolated.ttfts, 50), ratio(p(isolated.ttfts, 50), idle50), p(isolated.ttfts, 99), ratio(p(isolated.ttfts, 99), idle99), len(isolated.ttfts), isolated.chatFailed, isoPreemptions)
	b.Logf("chat TTFT classes + prefill isolation, slowest: %v", slowest(isolated.ttfts, 5))
	b.Logf("prefill isolation gate decisions (all proxies): %v", gate)
	b.Logf("agent output tokens/s: alone %.0f, with classes %.0f (%.1f%% of alone), classes disabled %.0f (%.1f%% of alone), classes + prefill cap %.0f (%.1f%% of alone), classes + prefill isolation %.0f (%.1f%% of alone); agent errors %d/%d/%d/%d/%d",
		alone.agentTokensPerSec, on.agentTokensPerSec, 100*on.agentTokensPerSec/alone.agentTokensPerSec,
		off.agentTokensPerSec, 100*off.agentTokensPerSec/alone.agentTokensPerSec,
		capped.agentTokensPerSec, 100*capped.agentTokensPerSec/alone.agentTokensPerSec,
		isolated.agentTokensPerSec, 100*isolated.agentTokensPerSec/alone.agentTokensPerSec,
		alone.agentErrors, on.agentErrors, off.agentErrors, capped.agentErrors, isolated.agentErrors)
	b.Logf("agent requests in flight at the engines with classes: peak %d (cap %d = %d × (%d − %d)); interactive shed by the proxies: %d",
		on.peakAgents, agentCap, haEngines, haMaxNumSeqs, haReserve, rejected)
	b.Logf("targets: chat TTFT p99 with classes ≤ 1.5× idle: %v; agents with classes ≥ 80%% of alone: %v",
		ratio(p(on.ttfts, 99), idle99) <= 1.5, on.agentTokensPerSec >= 0.8*alone.agentTokensPerSec)
	b.Logf("targets with prefill isolation: chat TTFT p99 ≤ 1.5× idle: %v; agents ≥ 80%% of alone: %v; no chat refused: %v",
		ratio(p(isolated.ttfts, 99), idle99) <= 1.5, isolated.agentTokensPerSec >= 0.8*alone.agentTokensPerSec, len(isolated.chatFailed) == 0)
	b.ReportMetric(float64(p(isolated.ttfts, 99))/float64(time.Millisecond), "chat-isolated-p99-ms")
	b.ReportMetric(isolated.agentTokensPerSec, "agent-isolated-tok/s")
	b.ReportMetric(float64(p(on.ttfts, 99))/float64(time.Millisecond), "chat-p99-ms")
	b.ReportMetric(float64(idle99)/float64(time.Millisecond), "chat-idle-p99-ms")
	b.ReportMetric(on.agentTokensPerSec, "agent-tok/s")
	b.ReportMetric(alone.agentTokensPerSec, "alone-tok/s")
	// What the scenario must hold, whatever the figures.
	if len(on.chatFailed) > 0 {
		b.Errorf("%d chat requests refused or failed with classes: %v", len(on.chatFailed), on.chatFailed)
	}
	if len(isolated.chatFailed) > 0 {
		b.Errorf("%d chat requests refused or failed with prefill isolation: %v", len(isolated.chatFailed), isolated.chatFailed)
	}
	if on.peakAgents > agentCap {
		b.Errorf("the engines saw %d agent requests in flight, above the fleet-wide cap %d", on.peakAgents, agentCap)
	}
}

// slowest returns the n largest of d, largest first, rounded to ms.
func slowest(d []time.Duration, n int) []time.Duration {
	out := slices.Clone(d)
	slices.SortFunc(out, func(a, b time.Duration) int { return cmp.Compare(b, a) })
	out = out[:min(n, len(out))]
	for i := range out {
		out[i] = out[i].Round(time.Millisecond)
	}
	return out
}
