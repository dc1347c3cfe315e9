package system

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// BenchmarkAffinity (make bench-affinity; docs/routing.md, "Measured"):
// 16 multi-turn agent loops, each turn resending the growing
// conversation, over 4 vllm-sim engines with prefix caching behind 3
// proxies (each loop's turns rotate over the proxies), once with the
// model group's strategy affinity and once, in the same run on 4 fresh
// engines, with weighted_shuffle. It reports the engines' prefix cache
// hit ratio (vllm:prefix_cache_hits_total ÷ queries_total) of each, the
// agent tokens/s (generated tokens per wall second) of each and their
// ratio, and the max/mean of the engines' average in-flight requests
// (running + waiting, sampled every 10 ms) of each. Bounded: 16 loops ×
// 16 turns per strategy, a few seconds each.
func BenchmarkAffinity(b *testing.B) {
	const loops, turns, engines, proxies = 16, 16, 4, 3
	// Loops start stagger apart, as agents do: a new session is placed by
	// rendezvous with bounded load on the fleet-wide in-flight counts,
	// which only see the sessions already running (16 placements in the
	// same millisecond all see an idle fleet and fall back to the plain
	// hash spread).
	const stagger = 40 * time.Millisecond
	d := startDist(b)
	ctx := context.Background()
	m := d.modelClient()
	groups := []string{"affinity", "weighted_shuffle"}
	sims := map[string][]*vllmsim.Server{}
	for _, g := range groups {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true,
			Routing: &adminv1.ModelGroupRouting{Strategy: g}}))
		require.NoError(b, err)
		for range engines {
			cfg := vllmsim.DefaultConfig()
			// Time 5× faster than real: a 4k-token prefill costs ~80 ms of
			// wall time, decoding 32 tokens ~64 ms.
			cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 5, 32
			sim := harness.StartSim(b, cfg)
			sims[g] = append(sims[g], sim)
			_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
				ModelGroup: g, ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: 64,
				Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
			require.NoError(b, err)
		}
	}
	tok := d.NewTenant("acme").Token
	var ps []*harness.Proxy
	for range proxies {
		p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.LimitsCallTimeout = 5 * time.Second })
		harness.Eventually(b, func() bool { return len(p.DP.Catalog().Deployments(groups[1])) == engines }, 10*time.Second, 10*time.Millisecond)
		ps = append(ps, p)
	}
	send := func(p *harness.Proxy, group, session string, msgs []map[string]string) (int, error) {
		body, _ := json.Marshal(map[string]any{"model": group, "max_tokens": 32, "messages": msgs})
		req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(string(body)))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("X-Session-Id", session)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode, nil
	}
	// New deployments' concurrency counts are in quarantine for their
	// first moments (limits_recovering): wait for every proxy to pass.
	for _, g := range groups {
		harness.Eventually(b, func() bool {
			for _, p := range ps {
				for range 2 * engines {
					if code, err := send(p, g, "warm", []map[string]string{{"role": "user", "content": "warm"}}); err != nil || code != http.StatusOK {
						return false
					}
				}
			}
			return true
		}, 30*time.Second, 100*time.Millisecond)
	}
	type result struct {
		hit, tokensPerSec, imbalance float64
		wall                         time.Duration
	}
	run := func(group string) result {
		ss := sims[group]
		before := make([]vllmsim.Stats, len(ss))
		for i, s := range ss {
			before[i] = s.Stats()
		}
		// Sample in-flight per engine while the loops run.
		stop := make(chan struct{})
		sums := make([]float64, len(ss))
		samples := 0
		var sampled sync.WaitGroup
		sampled.Add(1)
		go func() {
			defer sampled.Done()
			t := time.NewTicker(10 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
				}
				for i, s := range ss {
					st := s.Stats()
					sums[i] += float64(st.NumRunning + st.NumWaiting)
				}
				samples++
			}
		}()
		start := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, loops)
		for l := range loops {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(l) * stagger)
				session := fmt.Sprintf("%s-agent-%d", group, l)
				msgs := []map[string]string{{"role": "system", "content": fmt.Sprintf("You are agent %d. ", l) + strings.Repeat("Follow the tool protocol exactly and report every observation. ", 50)}}
				for turn := range turns {
					msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("observation %d: %s", turn, strings.Repeat("the build log shows a warning ", 40))})
					code, err := send(ps[(l+turn)%proxies], group, session, msgs)
					if err != nil || code != http.StatusOK {
						errs <- fmt.Errorf("loop %d turn %d: status %d, %w", l, turn, code, err)
						return
					}
					msgs = append(msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("step %d done", turn)})
				}
			}()
		}
		wg.Wait()
		wall := time.Since(start)
		close(stop)
		sampled.Wait()
		close(errs)
		for err := range errs {
			require.NoError(b, err)
		}
		var q, h, gen uint64
		var sum, peak float64
		per := make([]string, len(ss))
		for i, s := range ss {
			st := s.Stats()
			per[i] = fmt.Sprintf("%d", st.PromptTokens-before[i].PromptTokens)
			q += st.PrefixCacheQueries - before[i].PrefixCacheQueries
			h += st.PrefixCacheHits - before[i].PrefixCacheHits
			gen += st.GenerationTokens - before[i].GenerationTokens
			mean := sums[i] / float64(max(samples, 1))
			sum += mean
			peak = max(peak, mean)
		}
		r := result{wall: wall, tokensPerSec: float64(gen) / wall.Seconds()}
		if q > 0 {
			r.hit = float64(h) / float64(q)
		}
		if sum > 0 {
			r.imbalance = peak / (sum / float64(len(ss)))
		}
		b.Logf("%s: %d loops × %d turns in %s, prefix cache hit ratio %.3f, agent tokens/s %.0f, in-flight max/mean per engine %.2f (prompt tokens per engine %s)",
			group, loops, turns, wall.Round(time.Millisecond), r.hit, r.tokensPerSec, r.imbalance, strings.Join(per, "/"))
		return r
	}
	b.ResetTimer()
	for range b.N {
		aff := run("affinity")
		shuf := run("weighted_shuffle")
		b.ReportMetric(aff.hit, "hit_ratio_affinity")
		b.ReportMetric(shuf.hit, "hit_ratio_shuffle")
		b.ReportMetric(aff.tokensPerSec/shuf.tokensPerSec, "tokens/s_affinity/shuffle")
		b.ReportMetric(aff.imbalance, "inflight_max/mean_affinity")
		b.ReportMetric(shuf.imbalance, "inflight_max/mean_shuffle")
		b.Logf("affinity vs weighted_shuffle (same run): hit ratio %.3f vs %.3f, agent tokens/s %.0f vs %.0f (%.2f×), in-flight max/mean %.2f vs %.2f",
			aff.hit, shuf.hit, aff.tokensPerSec, shuf.tokensPerSec, aff.tokensPerSec/shuf.tokensPerSec, aff.imbalance, shuf.imbalance)
	}
}
