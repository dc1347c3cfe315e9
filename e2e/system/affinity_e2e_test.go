package system

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// affinityRig is two data planes over three simulated engines (prefix
// caching on) of model group "agents"; engine 2 alone can call tools.
type affinityRig struct {
	t       *testing.T
	sims    []*vllmsim.Server
	proxies []*harness.Proxy
	tok     string
}

func startAffinityRig(t *testing.T) *affinityRig { return startAffinityRigConc(t, 64) }

// startAffinityRigConc is startAffinityRig with every deployment's
// max_concurrency set to maxConc (fleet-wide leases); opts adjust the
// proxies' configs.
func startAffinityRigConc(t *testing.T, maxConc int64, opts ...func(*dataplane.Config)) *affinityRig {
	d := startDist(t)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "agents", PlatformWide: true}))
	require.NoError(t, err)
	r := &affinityRig{t: t}
	for i := range 3 {
		sim := startSim(t)
		r.sims = append(r.sims, sim)
		_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: "agents", ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: maxConc,
			Capabilities: &adminv1.Capabilities{Tools: i == 2},
			Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
	}
	r.tok = d.NewTenant("acme").Token
	for range 2 {
		// A generous limits deadline: this shared machine runs at a load
		// far above its cores, and a refused lease would move a turn.
		p := d.StartProxy("default", time.Minute, append([]func(*dataplane.Config){func(c *dataplane.Config) { c.LimitsCallTimeout = time.Second }}, opts...)...)
		harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("agents")) == 3 }, 10*time.Second, 10*time.Millisecond)
		harness.WaitStatus(t, p, r.tok, http.StatusOK, 10*time.Second)
		r.proxies = append(r.proxies, p)
	}
	return r
}

// turn sends one chat turn through proxy p and returns the engine that
// served it (the one whose prompt-token count grew).
func (r *affinityRig) turn(p int, session string, messages []map[string]string, tools bool) int {
	r.t.Helper()
	before := make([]uint64, len(r.sims))
	for i, s := range r.sims {
		before[i] = s.Stats().PromptTokens
	}
	body := map[string]any{"model": "agents", "max_tokens": 8, "messages": messages}
	if tools {
		body["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "ls", "parameters": map[string]any{"type": "object"}}}}
	}
	b, _ := json.Marshal(body)
	var status int
	var out []byte
	// New deployments' concurrency counts are in quarantine for their
	// first moments (limits_recovering, docs/limits.md): retry those.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		req, _ := http.NewRequest(http.MethodPost, r.proxies[p].URL+"/v1/chat/completions", strings.NewReader(string(b)))
		req.Header.Set("Authorization", "Bearer "+r.tok)
		if session != "" {
			req.Header.Set("X-Session-Id", session)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(r.t, err)
		out, _ = io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		status = resp.StatusCode
		if status != http.StatusServiceUnavailable || !strings.Contains(string(out), "limits_recovering") || time.Now().After(deadline) {
			break
		}
	}
	require.Equal(r.t, http.StatusOK, status, "%s", out)
	served := -1
	for i, s := range r.sims {
		if s.Stats().PromptTokens > before[i] {
			require.Equal(r.t, -1, served, "two engines grew for one request")
			served = i
		}
	}
	require.NotEqual(r.t, -1, served)
	return served
}

// Sessions: every turn of a session, through either proxy, lands on one
// engine; the engines' prefix cache then serves the resent conversation.
// For comparison, the same loops sent straight to a random engine each
// turn (what a weighted shuffle does) are measured on fresh engines.
func TestAffinitySessionsAcrossProxies(t *testing.T) {
	t.Parallel()
	r := startAffinityRig(t)
	const sessions, turns = 6, 12
	total, onPin := 0, 0
	loops := func(send func(turn int, session string, msgs []map[string]string) int) {
		for s := range sessions {
			session := fmt.Sprintf("sess-%d", s)
			msgs := []map[string]string{{"role": "system", "content": strings.Repeat("You are agent "+session+". ", 40)}}
			first := -1
			for i := range turns {
				msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("step %d: %s", i, strings.Repeat("observe ", 30))})
				e := send(i, session, msgs)
				if first < 0 {
					first = e
				}
				total++
				if e == first {
					onPin++
				}
				msgs = append(msgs, map[string]string{"role": "assistant", "content": "ok"})
			}
		}
	}
	loops(func(i int, session string, msgs []map[string]string) int { return r.turn(i%2, session, msgs, false) })
	require.GreaterOrEqual(t, float64(onPin)/float64(total), 0.99, "%d of %d turns on their session's engine", onPin, total)
	ratio := hitRatio(r.sims)
	affTotal, affOn := total, onPin

	shuffled := []*vllmsim.Server{startSim(t), startSim(t), startSim(t)}
	total, onPin = 0, 0
	n := 0
	loops(func(_ int, _ string, msgs []map[string]string) int {
		n++
		e := int(uint64(n) * 0x9E3779B97F4A7C15 >> 62 % 3) // a fixed pseudo-random engine per turn
		b, _ := json.Marshal(map[string]any{"model": vllmsim.DefaultModel, "max_tokens": 8, "messages": msgs})
		resp, err := http.Post(shuffled[e].URL()+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		return e
	})
	t.Logf("affinity: %d/%d session turns on their engine, prefix cache hit ratio %.3f; shuffled: %d/%d, hit ratio %.3f",
		affOn, affTotal, ratio, onPin, total, hitRatio(shuffled))
}

// hitRatio is vllm:prefix_cache_hits_total ÷ vllm:prefix_cache_queries_total
// over sims.
func hitRatio(sims []*vllmsim.Server) float64 {
	var q, h uint64
	for _, s := range sims {
		st := s.Stats()
		q, h = q+st.PrefixCacheQueries, h+st.PrefixCacheHits
	}
	if q == 0 {
		return 0
	}
	return float64(h) / float64(q)
}

// After filters: a pin to an engine the request's capabilities rule out
// is never used (the request succeeds on the tool-capable engine), and
// the session's next plain turn returns to its pin.
func TestAffinityPinAfterFilters(t *testing.T) {
	t.Parallel()
	r := startAffinityRig(t)
	msgs := []map[string]string{{"role": "user", "content": "hello"}}
	var session string
	pinned := -1
	for i := 0; pinned < 0 || pinned == 2; i++ { // a session pinned to an engine without tools
		require.Less(t, i, 50)
		session = fmt.Sprintf("f-%d", i)
		pinned = r.turn(0, session, msgs, false)
	}
	// The pin is written off the request path: wait until a plain turn
	// through the other proxy lands on it.
	harness.Eventually(t, func() bool { return r.turn(1, session, msgs, false) == pinned }, 5*time.Second, 10*time.Millisecond)
	for i := range 6 {
		require.Equal(t, 2, r.turn(i%2, session, msgs, true), "a tools request on an engine without tools")
	}
	for i := range 6 {
		require.Equal(t, pinned, r.turn(i%2, session, msgs, false), "the pin was not kept")
	}
}

// pinnedSession returns a session pinned (through both proxies) to an
// engine other than 2.
func (r *affinityRig) pinnedSession(msgs []map[string]string) (string, int) {
	r.t.Helper()
	var session string
	pinned := -1
	for i := 0; pinned < 0 || pinned == 2; i++ {
		require.Less(r.t, i, 50)
		session = fmt.Sprintf("p-%d", i)
		pinned = r.turn(0, session, msgs, false)
	}
	harness.Eventually(r.t, func() bool { return r.turn(1, session, msgs, false) == pinned }, 5*time.Second, 10*time.Millisecond)
	return session, pinned
}

// A full engine (its fleet-wide max_concurrency taken through the other
// proxy) is skipped for one turn; the next turn returns to the pin.
func TestAffinityPinnedEngineFull(t *testing.T) {
	t.Parallel()
	pinnedEngineFull(t, startAffinityRigConc(t, 1))
}

// The same on a 3-master Redis Cluster (--redis-cluster): the session's
// pin (its org's slot) and the engines' fleet-wide leases (each engine's
// own slot) live on different nodes, and both proxies see them.
func TestAffinityPinnedEngineFullOnRedisCluster(t *testing.T) {
	t.Parallel()
	rc := testsvc.StartRedisCluster(t)
	pinnedEngineFull(t, startAffinityRigConc(t, 1, func(c *dataplane.Config) { c.RedisClusterAddrs = rc.Addrs }))
}

// pinnedEngineFull: a full engine (its fleet-wide max_concurrency of 1
// taken through proxy 0) is skipped for one turn through proxy 1; the
// next turns return to the pin.
func pinnedEngineFull(t *testing.T, r *affinityRig) {
	msgs := []map[string]string{{"role": "user", "content": "hello"}}
	session, pinned := r.pinnedSession(msgs)
	// Hold the pinned engine's one slot: a slow request through proxy 0.
	require.NoError(t, r.sims[pinned].SetFaults(vllmsim.Faults{Delay: 3 * time.Second}))
	held := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, r.proxies[0].URL+"/v1/chat/completions",
			strings.NewReader(`{"model":"agents","max_tokens":4,"messages":[{"role":"user","content":"hold"}]}`))
		req.Header.Set("Authorization", "Bearer "+r.tok)
		req.Header.Set("X-Session-Id", session)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			held <- 0
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		held <- resp.StatusCode
	}()
	// Once proxy 0 holds the slot (fleet-wide), a turn through proxy 1
	// goes elsewhere.
	harness.Eventually(t, func() bool { return inFlight(t, r.proxies[0]) == 1 }, 2*time.Second, 5*time.Millisecond)
	require.NotEqual(t, pinned, r.turn(1, session, msgs, false))
	require.NoError(t, r.sims[pinned].SetFaults(vllmsim.Faults{}))
	require.Equal(t, http.StatusOK, <-held)
	for i := range 4 {
		require.Equal(t, pinned, r.turn(i%2, session, msgs, false), "the turn after the full one did not return to the pin")
	}
}

// An engine failing (503) loses the session's turns to others while it
// fails; once it recovers (and its ejection ends) the session returns.
func TestAffinityPinnedEngineFailing(t *testing.T) {
	t.Parallel()
	r := startAffinityRig(t)
	msgs := []map[string]string{{"role": "user", "content": "hello"}}
	session, pinned := r.pinnedSession(msgs)
	require.NoError(t, r.sims[pinned].SetFaults(vllmsim.Faults{Status: http.StatusServiceUnavailable}))
	for i := range 4 {
		require.NotEqual(t, pinned, r.turn(i%2, session, msgs, false))
	}
	require.NoError(t, r.sims[pinned].SetFaults(vllmsim.Faults{}))
	harness.Eventually(t, func() bool { return r.turn(0, session, msgs, false) == pinned }, 30*time.Second, 100*time.Millisecond,
		"the session never returned to its engine")
}

// inFlight sums p's sluice_proxy_upstream_in_flight.
func inFlight(t *testing.T, p *harness.Proxy) float64 {
	mfs, err := p.DP.Gatherer().Gather()
	require.NoError(t, err)
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "sluice_proxy_upstream_in_flight" {
			for _, m := range mf.GetMetric() {
				n += m.GetGauge().GetValue()
			}
		}
	}
	return n
}
