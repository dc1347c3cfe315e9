package gateway

import (
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	oai "github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// manyRetries lifts the retry budget's minimum: these tests count
// attempts, not the budget.
func manyRetries(c *Config) { c.RetryBudgetMin = 1000 }

// deadBase is the api_base of an engine that refuses connections.
func deadBase(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return "http://" + addr + "/v1"
}

func toolsCaps(tools bool) func(*configv1.Deployment) {
	return func(d *configv1.Deployment) { d.Capabilities = &configv1.Capabilities{Tools: tools} }
}

// fallbackEnv: group "primary" (tools) whose only engine is dead, with
// the fallbacks "plain" (no tool calling) then "tooled" (tools).
func fallbackEnv(t *testing.T, fallbacks ...string) (e *env, plain, tooled *fakeEngine, tok string) {
	e = newEnv(t, manyRetries)
	plain = newFakeEngine(t, engineStatus(200, "", okBody))
	tooled = newFakeEngine(t, engineStatus(200, "", okBody))
	e.snap.ModelGroups = append(e.snap.ModelGroups,
		&configv1.ModelGroup{PlatformWide: true, Name: "primary", Fallbacks: fallbacks}, &configv1.ModelGroup{PlatformWide: true, Name: "plain"}, &configv1.ModelGroup{PlatformWide: true, Name: "tooled"})
	e.deploy("d-dead", "primary", deadBase(t), toolsCaps(true))
	e.deploy("d-plain", "plain", plain.base(), toolsCaps(false))
	e.deploy("d-tooled", "tooled", tooled.base(), toolsCaps(true))
	tok = e.key("k1", nil)
	e.apply()
	return e, plain, tooled, tok
}

const toolsExtra = `"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]`

// TestFallbackSkipsGroupWithoutCapability: a request with tools whose
// primary is down never goes to a fallback group without tool calling;
// the answer names why it was skipped. With a fallback that fits, it is
// served there: the header and the usage event name the group used, and
// the routing reason is "fallback".
func TestFallbackSkipsGroupWithoutCapability(t *testing.T) {
	t.Parallel()
	e, plain, _, tok := fallbackEnv(t, "plain")
	resp := e.post("/v1/chat/completions", tok, chatBody("primary", toolsExtra))
	ae := readErr(t, resp)
	require.Equal(t, http.StatusBadGateway, ae.Status)
	require.Equal(t, oai.CodeUpstreamError, ae.Error.Code)
	require.Contains(t, ae.Error.Message, `model group "plain" skipped: no deployment of model "plain" supports tool calling`)
	require.Zero(t, plain.n.Load(), "the group without tool calling received the request")

	// Without tools the same fallback serves it.
	resp = e.post("/v1/chat/completions", tok, chatBody("primary", ""))
	require.Equal(t, http.StatusOK, resp.StatusCode)
	resp.Body.Close()
	require.Equal(t, "plain", resp.Header.Get(oai.HeaderModelGroup))
	ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
	require.Equal(t, "primary", ev.ModelGroup)
	require.Equal(t, "plain", ev.ServedModelGroup)
	require.Equal(t, reasonFallback, ev.RoutingReason)
	require.Equal(t, int32(2), ev.Attempts, "the dead primary, then the fallback")
}

func TestFallbackWithCapabilityServes(t *testing.T) {
	t.Parallel()
	e, plain, tooled, tok := fallbackEnv(t, "plain", "tooled")
	for range 5 { // the dead primary gets ejected on the way: later requests go to the fallback first
		resp := e.post("/v1/chat/completions", tok, chatBody("primary", toolsExtra))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		resp.Body.Close()
		require.Equal(t, "tooled", resp.Header.Get(oai.HeaderModelGroup))
		ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
		require.Equal(t, "tooled", ev.ServedModelGroup)
		require.Equal(t, "d-tooled", ev.DeploymentId)
		require.Equal(t, reasonFallback, ev.RoutingReason)
	}
	require.Zero(t, plain.n.Load())
	require.Equal(t, int64(5), tooled.n.Load())
	// Once the primary is ejected (3 connect failures), its group is
	// entirely down and the fallback is tried first: one attempt.
	resp := e.post("/v1/chat/completions", tok, chatBody("primary", toolsExtra))
	resp.Body.Close()
	require.Equal(t, "1", resp.Header.Get(oai.HeaderAttempts))
}

// TestContextWindowFallback: a prompt beyond the primary's context
// window goes to a fallback group with a larger one (LiteLLM's
// context_window_fallbacks); with none that fits, the answer is the
// primary's 400 naming the parameter and the skipped group.
func TestContextWindowFallback(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	small := newFakeEngine(t, engineStatus(200, "", okBody))
	large := newFakeEngine(t, engineStatus(200, "", okBody))
	e.snap.ModelGroups = append(e.snap.ModelGroups, &configv1.ModelGroup{PlatformWide: true, Name: "small", Fallbacks: []string{"medium", "large"}},
		&configv1.ModelGroup{PlatformWide: true, Name: "medium"}, &configv1.ModelGroup{PlatformWide: true, Name: "large"})
	e.deploy("d-small", "small", small.base(), func(d *configv1.Deployment) { d.Capabilities = &configv1.Capabilities{MaxInputTokens: 50} })
	e.deploy("d-medium", "medium", small.base(), func(d *configv1.Deployment) { d.Capabilities = &configv1.Capabilities{MaxInputTokens: 200} })
	e.deploy("d-large", "large", large.base(), func(d *configv1.Deployment) { d.Capabilities = &configv1.Capabilities{MaxInputTokens: 100000} })
	tok := e.key("k1", nil)
	e.apply()
	long := `{"model":"small","messages":[{"role":"user","content":"` + strings.Repeat("many words here ", 200) + `"}],"max_tokens":8}`
	resp := e.post("/v1/chat/completions", tok, long)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	resp.Body.Close()
	require.Equal(t, "large", resp.Header.Get(oai.HeaderModelGroup))
	require.Zero(t, small.n.Load(), "the small and medium windows were skipped")
	require.Equal(t, int64(1), large.n.Load())

	short := chatBody("small", "")
	resp = e.post("/v1/chat/completions", tok, short)
	resp.Body.Close()
	require.Equal(t, "small", resp.Header.Get(oai.HeaderModelGroup), "a prompt that fits stays on its group")

	// A key override without the large group: the primary's 400 names the
	// parameter and the skipped fallback.
	tok2 := e.key("k2", func(k *configv1.Key) {
		k.Fallbacks = map[string]*configv1.ModelGroupFallbacks{"small": {ModelGroups: []string{"medium"}}}
	})
	e.apply()
	ae := readErr(t, e.post("/v1/chat/completions", tok2, long))
	require.Equal(t, http.StatusBadRequest, ae.Status)
	require.Equal(t, oai.CodeUnsupportedParameter, ae.Error.Code)
	require.Contains(t, ae.Error.Message, `model group "medium" skipped`)
}

// TestFallbackOverrides: a team's override replaces the group's list for
// its keys, a key's replaces the team's, an empty list turns fallbacks
// off; fallbacks are followed transitively.
func TestFallbackOverrides(t *testing.T) {
	t.Parallel()
	e := newEnv(t, manyRetries)
	a := newFakeEngine(t, engineStatus(200, "", okBody))
	b := newFakeEngine(t, engineStatus(200, "", okBody))
	e.snap.ModelGroups = append(e.snap.ModelGroups, &configv1.ModelGroup{PlatformWide: true, Name: "primary", Fallbacks: []string{"mid"}},
		&configv1.ModelGroup{PlatformWide: true, Name: "mid", Fallbacks: []string{"a"}}, &configv1.ModelGroup{PlatformWide: true, Name: "a"}, &configv1.ModelGroup{PlatformWide: true, Name: "b"})
	e.deploy("d-dead", "primary", deadBase(t), nil)
	e.deploy("d-mid", "mid", deadBase(t), nil)
	e.deploy("d-a", "a", a.base(), nil)
	e.deploy("d-b", "b", b.base(), nil)
	e.snap.Teams[0].Fallbacks = map[string]*configv1.ModelGroupFallbacks{"primary": {ModelGroups: []string{"b"}}}
	e.snap.Teams = append(e.snap.Teams, &configv1.Team{Id: "t2", OrgId: "o1"})
	e.snap.Members = append(e.snap.Members, &configv1.Member{TeamId: "t2", UserId: "u1", OrgId: "o1"})
	teamTok := e.key("k-team", nil)
	keyTok := e.key("k-own", func(k *configv1.Key) {
		k.Fallbacks = map[string]*configv1.ModelGroupFallbacks{"primary": {ModelGroups: []string{"mid"}}}
	})
	offTok := e.key("k-off", func(k *configv1.Key) {
		k.Fallbacks = map[string]*configv1.ModelGroupFallbacks{"primary": {}}
	})
	plainTok := e.key("k-plain", func(k *configv1.Key) { k.TeamId = "t2" })
	e.apply()
	served := func(tok string) (int, string) {
		resp := e.post("/v1/chat/completions", tok, chatBody("primary", ""))
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get(oai.HeaderModelGroup)
	}
	st, g := served(teamTok)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, "b", g, "the team's override")
	st, g = served(keyTok)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, "a", g, "the key's override, then mid's own fallback (transitive)")
	st, _ = served(offTok)
	require.Equal(t, http.StatusBadGateway, st, "fallbacks turned off by the key")
	st, g = served(plainTok)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, "a", g, "the group's own list, followed through mid")
}

// TestFallbackSharesAttemptBudget: attempts across fallback groups share
// the request's one attempt budget (the group's max_attempts).
func TestFallbackSharesAttemptBudget(t *testing.T) {
	t.Parallel()
	e := newEnv(t, manyRetries)
	down := newFakeEngine(t, engineStatus(503, "", `{"error":"down"}`))
	last := newFakeEngine(t, engineStatus(200, "", okBody))
	e.snap.ModelGroups = append(e.snap.ModelGroups,
		&configv1.ModelGroup{PlatformWide: true, Name: "p", Fallbacks: []string{"f1", "f2"}, Resilience: &configv1.ModelGroupResilience{MaxAttempts: 2}},
		&configv1.ModelGroup{PlatformWide: true, Name: "f1"}, &configv1.ModelGroup{PlatformWide: true, Name: "f2"})
	e.deploy("d-p", "p", down.base(), nil)
	e.deploy("d-f1", "f1", down.base(), nil)
	e.deploy("d-f2", "f2", last.base(), nil)
	tok := e.key("k1", nil)
	e.apply()
	resp := e.post("/v1/chat/completions", tok, chatBody("p", ""))
	ae := readErr(t, resp)
	require.Equal(t, http.StatusServiceUnavailable, ae.Status)
	require.Equal(t, "2", ae.Header.Get(oai.HeaderAttempts), "max_attempts 2 across the groups")
	require.Zero(t, last.n.Load())
}

// TestGroupTTFTAndPanic: a model group's TTFT deadline replaces the
// proxy's; past its panic threshold a pool is used whole.
func TestGroupTTFTAndPanic(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.TTFTTimeout = time.Minute })
	stall := newFakeEngine(t, stream(5*time.Second, 0, 1, false))
	fast := newFakeEngine(t, stream(0, 0, 2, false))
	e.snap.ModelGroups = append(e.snap.ModelGroups,
		&configv1.ModelGroup{PlatformWide: true, Name: "g", Resilience: &configv1.ModelGroupResilience{TtftTimeoutMs: 200}})
	e.deploy("d-stall", "g", stall.base(), func(d *configv1.Deployment) { d.Weight = 1000 })
	e.deploy("d-fast", "g", fast.base(), func(d *configv1.Deployment) { d.Weight = 1 })
	tok := e.key("k1", nil)
	e.apply()
	start := time.Now()
	var served string
	for served != "d-fast" || stall.n.Load() == 0 {
		resp := e.post("/v1/chat/completions", tok, chatBody("g", `"stream":true`))
		require.Equal(t, http.StatusOK, resp.StatusCode)
		sseData(t, resp.Body)
		resp.Body.Close()
		ev := e.sink.byID(t, resp.Header.Get(oai.RequestIDHeader))
		served = ev.DeploymentId
		if stall.n.Load() > 0 && served == "d-fast" {
			require.Equal(t, int32(2), ev.Attempts)
		}
		require.Less(t, time.Since(start), 30*time.Second)
	}
	require.Less(t, time.Since(start), 5*time.Second, "the group's 200 ms TTFT deadline, not the proxy's minute")

	// Panic threshold: 2 of 3 deployments down (67% > 50%): all are used.
	p := newEnv(t, func(c *Config) { c.PanicThresholdPercent = 50 })
	ok := newFakeEngine(t, engineStatus(200, "", okBody))
	p.group("h")
	ids := []string{"h1", "h2", "h3"}
	for _, id := range ids {
		p.deploy(id, "h", ok.base(), nil)
	}
	ptok := p.key("k1", nil)
	p.apply()
	for _, id := range ids[:2] {
		p.h.states.Get(id).Health.Park(time.Now(), time.Minute)
	}
	seen := map[string]bool{}
	for i := 0; i < 60 && len(seen) < 3; i++ {
		resp := p.post("/v1/chat/completions", ptok, chatBody("h", ""))
		resp.Body.Close()
		seen[p.sink.byID(t, resp.Header.Get(oai.RequestIDHeader)).DeploymentId] = true
	}
	require.Len(t, seen, 3, "past the panic threshold the whole pool is in rotation")
}

// TestEjectionReturnCounted: a passive ejection is counted when it
// happens and its return when a request finds the deployment back, and
// the heartbeat's list shows it meanwhile.
func TestEjectionReturnCounted(t *testing.T) {
	t.Parallel()
	var fail atomic.Bool
	fail.Store(true)
	eng := newFakeEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if fail.Load() {
			engineStatus(http.StatusBadGateway, "", `{}`)(w, r)
			return
		}
		engineStatus(http.StatusOK, "", okBody)(w, r)
	})
	e := newEnv(t, func(c *Config) { c.NoRetries = true; c.EjectionBase, c.EjectionMax = 300*time.Millisecond, time.Second })
	e.group("g")
	e.deploy("x", "g", eng.base(), nil)
	e.deploy("y", "g", eng.base(), func(d *configv1.Deployment) { d.Weight = 1 })
	tok := e.key("k1", nil)
	e.apply()
	for e.h.states.Get("x").Health.EjectedUntil().IsZero() {
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		resp.Body.Close()
	}
	fail.Store(false)
	ej := e.h.Ejected()
	require.NotEmpty(t, ej)
	require.Equal(t, "ejected", ej[0].GetReason())
	waitFor(t, "the return", func() bool {
		resp := e.post(RouteChat, tok, chatBody("g", ""))
		resp.Body.Close()
		mfs, err := e.reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == "sluice_proxy_deployment_returns_total" {
				for _, m := range mf.GetMetric() {
					if m.GetLabel()[0].GetValue() == "x" && m.GetCounter().GetValue() == 1 {
						return true
					}
				}
			}
		}
		return false
	})
}
