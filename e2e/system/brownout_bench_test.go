package system

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func envOr(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// BenchmarkBrownout (make bench-brownout, docs/resilience.md): the issue's
// brownout through two data planes. Four vLLM simulators behind one group
// — 50% 503 (queue full, Retry-After 1 s), 429 with Retry-After 30 s,
// streams cut after 3 chunks, healthy but 20 ms slower — and an open-loop
// load of SLUICE_BENCH_BROWNOUT_RATE streams per second (default 200) for
// SLUICE_BENCH_BROWNOUT_SECONDS (default 60), alternating between the
// proxies. Reported: upstream attempts per client request (target ≤ 1.2),
// client errors by status and code (refusals, and streams cut mid-way by
// their error event's code), every deployment's attempts by its standing
// at the pick and outcome (sluice_proxy_upstream_attempts_total), the
// requests the 429ing engine received while parked (target 0: the
// proxies' count at the pick, and a check from outside on the timing of
// its 429s), the stream-cutter's failures before each ejection and the
// time to each return (half-open probe), the largest share of the pool
// any request found out of rotation. Then the amplification check:
// openai-go with its default retries against a pool where every engine
// answers 503. SLUICE_BENCH_BROWNOUT_PROBATION=off runs the proxies with
// --stream-probation=false (the behaviour before the stream probation,
// for a baseline); the held streams are reported by deployment, reason
// and outcome.
func BenchmarkBrownout(b *testing.B) {
	rate := envOr("SLUICE_BENCH_BROWNOUT_RATE", 200)
	dur := time.Duration(envOr("SLUICE_BENCH_BROWNOUT_SECONDS", 60)) * time.Second
	noProbation := os.Getenv("SLUICE_BENCH_BROWNOUT_PROBATION") == "off"
	d := startDist(b)
	ctx := context.Background()
	mk := func(edit func(*vllmsim.Config)) *vllmsim.Server {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 20, 8
		cfg.MaxNumSeqs = 1024
		edit(&cfg)
		return harness.StartSim(b, cfg)
	}
	flaky := mk(func(c *vllmsim.Config) { c.Faults.Status, c.Faults.Probability = 503, 0.5 })
	limited := mk(func(c *vllmsim.Config) { c.Faults.Status, c.Faults.RetryAfter = 429, 30*time.Second })
	cutter := mk(func(c *vllmsim.Config) { c.Faults.CutAfterChunks = 3 })
	slow := mk(func(c *vllmsim.Config) { c.Faults.Delay = 20 * time.Millisecond })
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen", PlatformWide: true}))
	require.NoError(b, err)
	ids := map[string]string{}
	for name, s := range map[string]*vllmsim.Server{"flaky": flaky, "limited": limited, "cutter": cutter, "slow": slow} {
		ids[name] = createDeployment(b, d, "qwen", s.URL()+"/v1", 1)
	}
	// The overloaded pool of the amplification check.
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "overloaded", PlatformWide: true}))
	require.NoError(b, err)
	var overIDs []string
	for range 4 {
		s := mk(func(c *vllmsim.Config) { c.Faults.Status = 503 })
		overIDs = append(overIDs, createDeployment(b, d, "overloaded", s.URL()+"/v1", 1))
	}
	ten := d.NewTenant("brownout-bench")
	var ps []*proxy
	for range 2 {
		ps = append(ps, d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.MaxRetries, c.NoStreamProbation = 3, noProbation }))
	}
	for _, p := range ps {
		harness.Eventually(b, func() bool {
			return len(p.DP.Catalog().Deployments("overloaded")) == 4 && len(p.DP.Catalog().Deployments("qwen")) == 4
		},
			10*time.Second, 10*time.Millisecond)
		harness.WaitStatus(b, p, ten.Token, http.StatusOK, 10*time.Second)
	}
	sum := func(name string, labels map[string]string) float64 {
		var v float64
		for _, p := range ps {
			v += promValue(b, p.DP.Gatherer(), name, labels)
		}
		return v
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}, Timeout: 30 * time.Second}
	defer hc.CloseIdleConnections()

	b.ResetTimer()
	for range b.N {
		var sent, attempts, ok, transport atomic.Int64
		var mu sync.Mutex
		refused := map[string]int{} // status and code of refusals
		cuts := map[string]int{}    // code of the error event of streams cut mid-way
		var maxOut float64
		// Per proxy: the cutter's ejections and returns, the 429er's 429s
		// seen from outside (sampled every 20 ms).
		type cutterEvent struct {
			at       time.Duration
			failures float64 // failures since the previous ejection (ejection), 0 (return)
			ejection bool
		}
		cutterEvents := make([][]cutterEvent, len(ps))
		limited429Beyond := 0.0 // 429s within a parking of the previous one (same proxy)
		stop := make(chan struct{})
		var sampler sync.WaitGroup
		start := time.Now()
		sampler.Add(1)
		go func() {
			defer sampler.Done()
			lastEj, lastRet, lastFails, last429 := make([]float64, len(ps)), make([]float64, len(ps)), make([]float64, len(ps)), make([]float64, len(ps))
			parkedAt := make([]time.Time, len(ps))
			for {
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
				for i, p := range ps {
					g := p.DP.Gatherer()
					now := time.Now()
					maxOut = max(maxOut, promValue(b, g, "sluice_proxy_pool_out_of_rotation_ratio", map[string]string{"model_group": "qwen"}))
					// A return and the failed probe that ejects it again often
					// fall in one sample: the return first.
					if r := promValue(b, g, "sluice_proxy_deployment_returns_total", map[string]string{"deployment": ids["cutter"], "reason": "ejected"}); r > lastRet[i] {
						lastRet[i] = r
						cutterEvents[i] = append(cutterEvents[i], cutterEvent{at: now.Sub(start)})
					}
					if ej := promValue(b, g, "sluice_proxy_deployment_ejections_total", map[string]string{"deployment": ids["cutter"], "reason": "failures"}); ej > lastEj[i] {
						lastEj[i] = ej
						f := deploymentErrors(b, g, ids["cutter"])
						cutterEvents[i] = append(cutterEvents[i], cutterEvent{now.Sub(start), f - lastFails[i], true})
						lastFails[i] = f
					}
					if n := promValue(b, g, "sluice_proxy_upstream_errors_total", map[string]string{"deployment": ids["limited"], "kind": "status_429"}); n > last429[i] {
						delta := n - last429[i]
						last429[i] = n
						// Requests sent with the one that parked it (before its
						// answer) arrive within moments of it; one arriving 1 s
						// or more after it and before the parking's end (less
						// two samples of slack) was sent while it was parked.
						switch since := now.Sub(parkedAt[i]); {
						case parkedAt[i].IsZero() || since >= 30*time.Second-40*time.Millisecond:
							parkedAt[i] = now
						case since >= time.Second:
							limited429Beyond += delta
						}
					}
				}
			}
		}()
		var wg sync.WaitGroup
		tick := time.NewTicker(time.Second / time.Duration(rate))
		for i := 0; time.Since(start) < dur; i++ {
			<-tick.C
			wg.Add(1)
			sent.Add(1)
			go func(p *proxy) {
				defer wg.Done()
				req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions",
					strings.NewReader(`{"model":"qwen","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":true}`))
				req.Header.Set("Authorization", "Bearer "+ten.Token)
				resp, err := hc.Do(req)
				if err != nil {
					transport.Add(1)
					return
				}
				defer func() { _ = resp.Body.Close() }()
				a, _ := strconv.Atoi(resp.Header.Get(dataplane.HeaderAttempts))
				attempts.Add(int64(a))
				last := ""
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					if v, found := strings.CutPrefix(sc.Text(), "data: "); found {
						last = v
					} else if resp.StatusCode != http.StatusOK && sc.Text() != "" {
						last = sc.Text()
					}
				}
				code := "other"
				if i := strings.Index(last, `"code":"`); i >= 0 {
					code = strings.SplitN(last[i+8:], `"`, 2)[0]
				}
				switch {
				case resp.StatusCode != http.StatusOK:
					mu.Lock()
					refused[strconv.Itoa(resp.StatusCode)+" "+code]++
					mu.Unlock()
				case last == "[DONE]":
					ok.Add(1)
				default:
					mu.Lock()
					cuts[code]++
					mu.Unlock()
				}
			}(ps[i%2])
		}
		tick.Stop()
		wg.Wait()
		close(stop)
		sampler.Wait()
		n := sent.Load()
		nRefused, nCut := 0, 0
		for _, c := range refused {
			nRefused += c
		}
		for _, c := range cuts {
			nCut += c
		}
		// Every upstream attempt by deployment, standing at its pick and
		// outcome (sluice_proxy_upstream_attempts_total).
		byDep := map[string]map[string]float64{}
		for name, id := range ids {
			byDep[name] = map[string]float64{}
			for _, p := range ps {
				for k, v := range attemptsByState(b, p.DP.Gatherer(), id) {
					byDep[name][k] += v
				}
			}
		}
		limitedWhileParked := 0.0
		for k, v := range byDep["limited"] {
			if strings.HasPrefix(k, "parked/") {
				limitedWhileParked += v
			}
		}
		limitedReceived := sum("sluice_proxy_upstream_errors_total", map[string]string{"deployment": ids["limited"], "kind": "status_429"})
		refusals := sum("sluice_proxy_retry_budget_refusals_total", map[string]string{"model_group": "qwen"})
		perReq := float64(attempts.Load()) / float64(n)
		elapsed := time.Since(start)
		b.Logf("brownout: %d streams at %d/s asked (%.0f/s reached) for %s through 2 proxies: %d ok, %d client errors: %d refused %v, %d cut mid-stream %v, %d transport errors",
			n, rate, float64(n)/dur.Seconds(), dur, ok.Load(), nRefused+nCut, nRefused, refused, nCut, cuts, transport.Load())
		b.Logf("brownout: %d upstream attempts, %.3f per client request (target <= 1.2); %.0f retries refused by the retry budget", attempts.Load(), perReq, refusals)
		for _, name := range []string{"flaky", "limited", "cutter", "slow"} {
			b.Logf("brownout: attempts at %-7s by standing/outcome: %v", name, byDep[name])
		}
		b.Logf("brownout: stream probation %v", !noProbation)
		for _, name := range []string{"flaky", "limited", "cutter", "slow"} {
			holds := map[string]float64{}
			for _, p := range ps {
				for k, v := range streamHolds(b, p.DP.Gatherer(), ids[name]) {
					holds[k] += v
				}
			}
			b.Logf("brownout: held streams at %-7s by reason/outcome: %v; proven %.0f, back on probation %.0f times", name, holds,
				sum("sluice_proxy_stream_probation_total", map[string]string{"deployment": ids[name], "event": "proven"}),
				sum("sluice_proxy_stream_probation_total", map[string]string{"deployment": ids[name], "event": "revoked"}))
		}
		b.Logf("brownout: the 429ing engine received %.0f requests, %.0f of them picked while parked (target 0); seen from outside: %.0f 429s 1-30 s after the one that parked it at the same proxy",
			limitedReceived, limitedWhileParked, limited429Beyond)
		for i, evs := range cutterEvents {
			var parts []string
			var ejAt time.Duration
			for _, e := range evs {
				if e.ejection {
					ejAt = e.at
					parts = append(parts, fmt.Sprintf("ejected at %.1fs after %.0f failures", e.at.Seconds(), e.failures))
				} else {
					parts = append(parts, fmt.Sprintf("back %.1fs later", (e.at-ejAt).Seconds()))
				}
			}
			b.Logf("brownout: the stream-cutter at proxy %d (ejection base 1 s, doubling): %s", i, strings.Join(parts, "; "))
		}
		b.Logf("brownout: largest share of the pool out of rotation seen by a request %.2f (max ejection percent 50); run took %s",
			maxOut, elapsed.Round(time.Millisecond))
		b.ReportMetric(perReq, "attempts/req")
		b.ReportMetric(float64(nRefused)/float64(n), "refused/req")
		b.ReportMetric(float64(nCut)/float64(n), "cut/req")
		b.ReportMetric(maxOut, "max-out-ratio")
		b.ReportMetric(limitedWhileParked, "limited-while-parked")

		// Amplification: openai-go's default retries (2) against a pool
		// where every engine answers 503.
		upBefore := 0.0
		for _, id := range overIDs {
			upBefore += sum("sluice_proxy_upstream_errors_total", map[string]string{"deployment": id, "kind": "status_503_queue_full"}) +
				sum("sluice_proxy_upstream_errors_total", map[string]string{"deployment": id, "kind": "status_5xx"})
		}
		const calls, conc = 100, 8
		var cw sync.WaitGroup
		var failed atomic.Int64
		next := make(chan int, calls)
		for i := range calls {
			next <- i
		}
		close(next)
		ampStart := time.Now()
		for range conc {
			cw.Add(1)
			go func() {
				defer cw.Done()
				for i := range next {
					cl := openai.NewClient(option.WithBaseURL(ps[i%2].URL+"/v1"), option.WithAPIKey(ten.Token))
					_, err := cl.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "overloaded", MaxTokens: openai.Int(4),
						Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")}})
					if err != nil {
						failed.Add(1)
					}
				}
			}()
		}
		cw.Wait()
		up := -upBefore
		for _, id := range overIDs {
			up += sum("sluice_proxy_upstream_errors_total", map[string]string{"deployment": id, "kind": "status_503_queue_full"}) +
				sum("sluice_proxy_upstream_errors_total", map[string]string{"deployment": id, "kind": "status_5xx"})
		}
		b.Logf("amplification: %d openai-go calls (default retries) against a fully overloaded pool, %d failed, in %s: %.0f upstream calls (%.2f per client call, target <= 1.2)",
			calls, failed.Load(), time.Since(ampStart).Round(time.Millisecond), up, up/calls)
		b.ReportMetric(up/calls, "upstream/sdk-call")
	}
}

// attemptsByState returns sluice_proxy_upstream_attempts_total of one
// deployment by "state/outcome".
func attemptsByState(tb testing.TB, g prometheus.Gatherer, id string) map[string]float64 {
	mfs, err := g.Gather()
	require.NoError(tb, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "sluice_proxy_upstream_attempts_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var dep, state, outcome string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "deployment":
					dep = l.GetValue()
				case "state":
					state = l.GetValue()
				case "outcome":
					outcome = l.GetValue()
				}
			}
			if dep == id {
				out[state+"/"+outcome] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}

// deploymentErrors sums sluice_proxy_upstream_errors_total of one
// deployment over every kind.
func deploymentErrors(tb testing.TB, g prometheus.Gatherer, id string) float64 {
	mfs, err := g.Gather()
	require.NoError(tb, err)
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != "sluice_proxy_upstream_errors_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "deployment" && l.GetValue() == id {
					v += m.GetCounter().GetValue()
				}
			}
		}
	}
	return v
}

// streamHolds reads sluice_proxy_stream_holds_total of deployment id by
// "reason/outcome".
func streamHolds(tb testing.TB, g prometheus.Gatherer, id string) map[string]float64 {
	mfs, err := g.Gather()
	require.NoError(tb, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "sluice_proxy_stream_holds_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var dep, reason, outcome string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "deployment":
					dep = l.GetValue()
				case "reason":
					reason = l.GetValue()
				case "outcome":
					outcome = l.GetValue()
				}
			}
			if dep == id {
				out[reason+"/"+outcome] += m.GetCounter().GetValue()
			}
		}
	}
	return out
}
