package system

import (
	"context"
	"io"
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

// strategyRig is nProxies data planes over nSims simulated engines of
// model group "s" with the given routing settings.
type strategyRig struct {
	t       *testing.T
	sims    []*vllmsim.Server
	deps    []string
	proxies []*harness.Proxy
	tok     string
	headers map[string]string
}

func startStrategyRig(t *testing.T, nSims, nProxies int, maxConc int64, routing *adminv1.ModelGroupRouting, simCfg func(*vllmsim.Config), opts ...func(*dataplane.Config)) *strategyRig {
	t.Helper()
	d := startDist(t)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "s", PlatformWide: true, Routing: routing}))
	require.NoError(t, err)
	r := &strategyRig{t: t}
	for range nSims {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 20, 16
		if simCfg != nil {
			simCfg(&cfg)
		}
		sim := harness.StartSim(t, cfg)
		r.sims = append(r.sims, sim)
		dep, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: "s", ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: maxConc,
			Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
		r.deps = append(r.deps, dep.Msg.Deployment.Id)
	}
	r.tok = d.NewTenant("acme").Token
	opts = append([]func(*dataplane.Config){func(c *dataplane.Config) { c.LimitsCallTimeout = time.Second }}, opts...)
	for range nProxies {
		p := d.StartProxy("default", time.Minute, opts...)
		harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("s")) == nSims }, 10*time.Second, 10*time.Millisecond)
		harness.WaitStatus(t, p, r.tok, http.StatusOK, 10*time.Second)
		r.proxies = append(r.proxies, p)
	}
	// New deployments' concurrency counts are in quarantine for their
	// first moments (limits_recovering, docs/limits.md), each from its
	// first admission, and a quarantined deployment is skipped like a
	// full one: wait until every proxy's requests pass several times in a
	// row and every engine has served one of them (so none is still in
	// quarantine when a test starts: every request would land on the
	// others).
	body := `{"model":"s","max_tokens":2,"messages":[{"role":"user","content":"warm"}]}`
	harness.Eventually(t, func() bool {
		for range 2 * nSims {
			for p := range r.proxies {
				if code, err := r.send(context.Background(), p, body); err != nil || code != http.StatusOK {
					return false
				}
			}
		}
		for _, s := range r.sims {
			if s.Stats().PromptTokens == 0 {
				return false
			}
		}
		return true
	}, 30*time.Second, 100*time.Millisecond, "the deployments never left quarantine")
	return r
}

// chat sends one request through proxy p and returns its status; a
// failure is logged.
func (r *strategyRig) chat(ctx context.Context, p int, body string) (int, error) {
	code, b, err := r.do(ctx, p, body)
	if err == nil && code != http.StatusOK {
		r.t.Logf("status %d: %s", code, b)
	}
	return code, err
}

// send is chat without the log.
func (r *strategyRig) send(ctx context.Context, p int, body string) (int, error) {
	code, _, err := r.do(ctx, p, body)
	return code, err
}

func (r *strategyRig) do(ctx context.Context, p int, body string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.proxies[p].URL+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Authorization", "Bearer "+r.tok)
	for k, v := range r.headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	b, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, b, nil
}

// inFlightBy sums sluice_proxy_upstream_in_flight per deployment over
// every proxy of the rig.
func (r *strategyRig) inFlightBy() map[string]float64 {
	out := map[string]float64{}
	for _, p := range r.proxies {
		mfs, err := p.DP.Gatherer().Gather()
		require.NoError(r.t, err)
		for _, mf := range mfs {
			if mf.GetName() != "sluice_proxy_upstream_in_flight" {
				continue
			}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "deployment" {
						out[l.GetValue()] += m.GetGauge().GetValue()
					}
				}
			}
		}
	}
	return out
}

// least_outstanding spreads by the fleet-wide in-flight count: slow
// requests sent one after another, alternating between two proxies, land
// two per engine on three engines (each proxy sees the other's leases).
func TestLeastOutstandingFleetWide(t *testing.T) {
	t.Parallel()
	r := startStrategyRig(t, 3, 2, 8, &adminv1.ModelGroupRouting{Strategy: "least_outstanding"}, nil)
	for _, s := range r.sims {
		require.NoError(t, s.SetFaults(vllmsim.Faults{Delay: 4 * time.Second}))
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var failed atomic.Int64
	const n = 6
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if code, err := r.chat(ctx, i%2, `{"model":"s","max_tokens":4,"messages":[{"role":"user","content":"slow"}]}`); err != nil || code != http.StatusOK {
				failed.Add(1)
			}
		}()
		harness.Eventually(t, func() bool {
			var sum float64
			for _, v := range r.inFlightBy() {
				sum += v
			}
			return sum == float64(i+1)
		}, 3*time.Second, 5*time.Millisecond, "request %d never went in flight", i)
	}
	by := r.inFlightBy()
	for _, id := range r.deps {
		require.Equal(t, 2.0, by[id], "in flight per deployment: %v", by)
	}
	for _, s := range r.sims {
		require.NoError(t, s.SetFaults(vllmsim.Faults{}))
	}
	wg.Wait()
	require.Zero(t, failed.Load())
}

// engine_load with one engine's /metrics hanging, then gone, then frozen:
// dispatch goes on at ≥ 50% of the throughput with every engine's metrics
// working, and no request fails.
func TestEngineLoadStaleMetrics(t *testing.T) {
	t.Parallel()
	r := startStrategyRig(t, 3, 1, 32, &adminv1.ModelGroupRouting{Strategy: "engine_load"}, nil, func(c *dataplane.Config) {
		c.EngineMetricsInterval, c.EngineMetricsMaxAge = 100*time.Millisecond, 400*time.Millisecond
		// This shared machine runs far above its cores: a generous limits
		// deadline, so that only routing can fail a request here.
		c.LimitsCallTimeout = 5 * time.Second
	})
	polls := func(outcome string) float64 {
		return counterSum(t, r.proxies[0], "sluice_proxy_engine_metrics_polls_total", "outcome", outcome)
	}
	harness.Eventually(t, func() bool { return polls("ok") >= 6 }, 10*time.Second, 20*time.Millisecond, "the engines' metrics were never polled")
	// load runs 6 clients for d and returns the requests completed; any
	// failure fails the test.
	load := func(d time.Duration) int64 {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		var done, failed atomic.Int64
		var wg sync.WaitGroup
		for range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for ctx.Err() == nil {
					code, err := r.chat(context.Background(), 0, `{"model":"s","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
					switch {
					case err != nil || code != http.StatusOK:
						failed.Add(1)
					default:
						done.Add(1)
					}
				}
			}()
		}
		wg.Wait()
		require.Zero(t, failed.Load(), "requests failed")
		return done.Load()
	}
	// Each fault is measured right after a baseline with every engine's
	// metrics working, so the ratio compares like with like on a machine
	// whose load drifts.
	for _, fault := range []string{vllmsim.MetricsHang, vllmsim.MetricsGone, vllmsim.MetricsFrozen} {
		base := load(2 * time.Second)
		require.Positive(t, base)
		require.NoError(t, r.sims[0].SetFaults(vllmsim.Faults{Metrics: fault}))
		errsBefore := polls("error")
		if fault != vllmsim.MetricsFrozen {
			harness.Eventually(t, func() bool { return polls("error") > errsBefore }, 10*time.Second, 20*time.Millisecond, "the %s endpoint never failed a poll", fault)
		}
		time.Sleep(500 * time.Millisecond) // past the max age: the sample is stale
		got := load(2 * time.Second)
		t.Logf("metrics %s: %d requests in 2 s, baseline (all metrics working) %d, ratio %.2f", fault, got, base, float64(got)/float64(base))
		require.GreaterOrEqual(t, float64(got), 0.5*float64(base), "metrics %s", fault)
		require.NoError(t, r.sims[0].SetFaults(vllmsim.Faults{}))
	}
	require.Positive(t, counterSum(t, r.proxies[0], "sluice_proxy_engine_load_inputs_total", "input", "stale"))
	require.Positive(t, counterSum(t, r.proxies[0], "sluice_proxy_engine_load_inputs_total", "input", "metrics"))
}

// counterSum sums the counter name of p over the series whose label has
// value.
func counterSum(t *testing.T, p *harness.Proxy, name, label, value string) float64 {
	t.Helper()
	mfs, err := p.DP.Gatherer().Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}
