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
// (running + waiting, sampled every 10 ms) of each. Two variants, each on
// both strategies (fresh engines each): "agent-id", where each loop's
// system prompt starts with "You are agent N." (every loop's first turn
// a cold prefill of its whole system prompt), and "shared", where every
// loop sends the same system prompt (as the sessions of one coding agent
// tool do: one system prompt and tool list) and its identity moves into
// its first user message. It also logs each variant's hit ratio ceiling
// (affinityCeiling). Bounded: 16 loops × 16 turns per strategy and
// variant, a few seconds each.
func BenchmarkAffinity(b *testing.B) {
	const loops, turns, engines, proxies = 16, 16, 4, 3
	// Loops start stagger apart, as agents do. A new session is placed on
	// the live sessions per engine (pinned, or placed while their first
	// turn runs), then the fleet-wide in-flight counts (docs/routing.md,
	// "Affinity").
	const stagger = 40 * time.Millisecond
	d := startDist(b)
	ctx := context.Background()
	m := d.modelClient()
	strategies := []string{"affinity", "weighted_shuffle"}
	// Groups: the strategy's name (variant agent-id, as before) and
	// <strategy>-shared (variant shared), each with its own engines.
	groups := []string{"affinity", "weighted_shuffle", "affinity-shared", "weighted_shuffle-shared"}
	sims := map[string][]*vllmsim.Server{}
	for _, g := range groups {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true,
			Routing: &adminv1.ModelGroupRouting{Strategy: strings.TrimSuffix(g, "-shared")}}))
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
		harness.Eventually(b, func() bool { return len(p.DP.Catalog().Deployments(groups[len(groups)-1])) == engines }, 10*time.Second, 10*time.Millisecond)
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
	// The conversation of loop l, turn by turn: the system prompt (the
	// loop's own, or the one every loop shares), then per turn an
	// observation and the answer resent.
	const system = "Follow the tool protocol exactly and report every observation. "
	systemOf := func(shared bool, l int) string {
		if shared {
			return "You are a coding agent. " + strings.Repeat(system, 50)
		}
		return fmt.Sprintf("You are agent %d. ", l) + strings.Repeat(system, 50)
	}
	userOf := func(shared bool, l, turn int) string {
		msg := fmt.Sprintf("observation %d: %s", turn, strings.Repeat("the build log shows a warning ", 40))
		if shared && turn == 0 {
			msg = fmt.Sprintf("You are agent %d. ", l) + msg
		}
		return msg
	}
	answerOf := func(turn int) string { return fmt.Sprintf("step %d done", turn) }
	for _, shared := range []bool{false, true} {
		c := affinityCeiling(loops, turns, engines, shared, systemOf, userOf, answerOf)
		b.Logf("variant %s: hit ratio ceiling %.3f (every turn of a loop on one engine that kept its prefix: %s)", variantName(shared), c.ratio, c.why)
	}
	run := func(group string) result {
		shared := strings.HasSuffix(group, "-shared")
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
				msgs := []map[string]string{{"role": "system", "content": systemOf(shared, l)}}
				for turn := range turns {
					msgs = append(msgs, map[string]string{"role": "user", "content": userOf(shared, l, turn)})
					code, err := send(ps[(l+turn)%proxies], group, session, msgs)
					if err != nil || code != http.StatusOK {
						errs <- fmt.Errorf("loop %d turn %d: status %d, %w", l, turn, code, err)
						return
					}
					msgs = append(msgs, map[string]string{"role": "assistant", "content": answerOf(turn)})
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
		b.Logf("%s (variant %s): %d loops × %d turns in %s, prefix cache hit ratio %.3f, agent tokens/s %.0f, in-flight max/mean per engine %.2f (prompt tokens per engine %s)",
			group, variantName(shared), loops, turns, wall.Round(time.Millisecond), r.hit, r.tokensPerSec, r.imbalance, strings.Join(per, "/"))
		return r
	}
	b.ResetTimer()
	for range b.N {
		for _, shared := range []bool{false, true} {
			suffix, name := "", variantName(shared)
			if shared {
				suffix = "-shared"
			}
			aff := run(strategies[0] + suffix)
			shuf := run(strategies[1] + suffix)
			metric := func(m string) string {
				if shared {
					return m + "_shared"
				}
				return m
			}
			b.ReportMetric(aff.hit, metric("hit_ratio_affinity"))
			b.ReportMetric(shuf.hit, metric("hit_ratio_shuffle"))
			b.ReportMetric(aff.tokensPerSec/shuf.tokensPerSec, metric("tokens/s_affinity/shuffle"))
			b.ReportMetric(aff.imbalance, metric("inflight_max/mean_affinity"))
			b.ReportMetric(shuf.imbalance, metric("inflight_max/mean_shuffle"))
			b.Logf("variant %s, affinity vs weighted_shuffle (same run): hit ratio %.3f vs %.3f, agent tokens/s %.0f vs %.0f (%.2f×), in-flight max/mean %.2f vs %.2f",
				name, aff.hit, shuf.hit, aff.tokensPerSec, shuf.tokensPerSec, aff.tokensPerSec/shuf.tokensPerSec, aff.imbalance, shuf.imbalance)
		}
	}
}

func variantName(shared bool) string {
	if shared {
		return "shared"
	}
	return "agent-id"
}

// ceiling is a variant's prefix cache hit ratio ceiling.
type ceiling struct {
	ratio float64
	why   string
}

// affinityCeiling is the hit ratio (cached prompt tokens ÷ prompt
// tokens, as the engines count them) of the best routing of the bench's
// loops: every turn of a loop on one engine whose cache kept everything.
// The simulator's chat template (ChatML) is prefix-stable, so turn t's
// prompt starts with the whole prompt of turn t-1, of which the engine
// reuses the whole 16-token blocks (vLLM never reuses a prompt's last
// token: P(t-1) < P(t) here); the rest of turn t (the answer resent, the
// new observation, the template around them) is new. A loop's first turn
// is cold, except in the shared variant on an engine that already served
// another loop's first turn: there its whole-block part of the shared
// system prompt hits (one cold system prompt per engine, the best case).
func affinityCeiling(loops, turns, engines int, shared bool, systemOf func(bool, int) string, userOf func(bool, int, int) string, answerOf func(int) string) ceiling {
	const block = vllmsim.DefaultBlockSize
	whole := func(n int) int { return n / block * block }
	msg := func(role, text string) string { return "<|im_start|>" + role + "\n" + text + "<|im_end|>\n" }
	var prompt, cached, firstP, laterNew int
	for l := range loops {
		conv := msg("system", systemOf(shared, l))
		prev := 0
		for turn := range turns {
			conv += msg("user", userOf(shared, l, turn))
			p := vllmsim.CountTokens(conv + "<|im_start|>assistant\n")
			prompt += p
			switch {
			case turn > 0:
				cached += whole(prev)
				laterNew += p - whole(prev)
			case shared && l >= engines:
				cached += whole(vllmsim.CountTokens(msg("system", systemOf(shared, l))))
			}
			if turn == 0 && l == 0 {
				firstP = p
			}
			prev = p
			conv += msg("assistant", answerOf(turn))
		}
	}
	r := float64(cached) / float64(prompt)
	return ceiling{r, fmt.Sprintf("%d prompt tokens, %d cached; a first turn %d tokens, a later turn %d new tokens on average",
		prompt, cached, firstP, laterNew/(loops*(turns-1)))}
}
