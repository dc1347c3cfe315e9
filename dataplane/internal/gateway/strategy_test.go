package gateway

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/upstream"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// setRouting sets group g's routing settings and republishes the catalog.
func (ae *affinityEnv) setRouting(r *configv1.ModelGroupRouting) {
	ae.snap.ModelGroups[0].Routing = r
	ae.apply()
}

// setClass sets the key's traffic class.
func (ae *affinityEnv) setClass(c configv1.TrafficClass) {
	ae.snap.Keys[0].TrafficClass = c
	ae.apply()
}

// hold takes n fleet-wide max_concurrency leases of deployment id, as
// requests through other proxies would.
func (ae *affinityEnv) hold(id string, n int, maxConc int64) []*limits.Lease {
	ae.t.Helper()
	var out []*limits.Lease
	for i := range n {
		dec, err := ae.lim.Admit(context.Background(), limits.Request{OrgID: limits.DeploymentOrg(id),
			RequestID: "other-proxy-" + id + "-" + string(rune('a'+i)),
			Scopes:    []limits.Scope{{Kind: limits.KindDeployment, ID: id, MaxParallel: maxConc}}})
		require.NoError(ae.t, err)
		require.True(ae.t, dec.Allowed)
		out = append(out, dec.Lease)
	}
	return out
}

func (ae *affinityEnv) release(ls []*limits.Lease) {
	for _, l := range ls {
		_, err := ae.lim.Cancel(context.Background(), l)
		require.NoError(ae.t, err)
	}
}

func longPrefixBody(turn string) string {
	system := strings.Repeat("You are a meticulous assistant for the Sluice test suite. ", 60)
	return `{"model":"g","max_tokens":8,"messages":[{"role":"system","content":"` + system + `"},{"role":"user","content":"` + turn + `"}]}`
}

// Without a group strategy: interactive requests without a session are
// shuffled (even with a long prefix), with a session they keep their
// pin; agent and batch requests use affinity. An explicit strategy
// overrides the defaults for every class.
func TestStrategyDefaultsByClass(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	for range 4 {
		require.Equal(t, reasonShuffle, ae.call(longPrefixBody("q")).RoutingReason, "interactive without a session")
	}
	first := ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, reasonLoad, first.RoutingReason)
	ae.waitPin("s1", first.DeploymentId)
	require.Equal(t, reasonSession, ae.call(chatBody("g", ""), "x-session-id", "s1").RoutingReason, "interactive with a session")

	for _, c := range []configv1.TrafficClass{configv1.TrafficClass_TRAFFIC_CLASS_AGENT, configv1.TrafficClass_TRAFFIC_CLASS_BATCH} {
		ae.setClass(c)
		ev := ae.call(longPrefixBody("q"))
		require.Equal(t, reasonPrefix, ev.RoutingReason, "%s", c)
		for i := range 5 {
			require.Equal(t, ev.DeploymentId, ae.call(longPrefixBody(strings.Repeat("q", i+2))).DeploymentId)
		}
	}

	// Explicit affinity: interactive requests are steered by prefix too.
	ae.setClass(configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE)
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyAffinity})
	require.Equal(t, reasonPrefix, ae.call(longPrefixBody("q")).RoutingReason)
	// Explicit weighted_shuffle: sessions are neither read nor pinned.
	ae.setClass(configv1.TrafficClass_TRAFFIC_CLASS_AGENT)
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyWeightedShuffle})
	for range 4 {
		require.Equal(t, reasonShuffle, ae.call(chatBody("g", ""), "x-session-id", "s-shuffled").RoutingReason)
	}
	time.Sleep(50 * time.Millisecond) // a pin would be written off the request path by now
	require.Empty(t, ae.pin("s-shuffled"))
	// A strategy this build does not know counts as none (agent: affinity).
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: "from_the_future"})
	require.Equal(t, reasonPrefix, ae.call(longPrefixBody("q")).RoutingReason)
}

// The group's session_ttl is the pin's TTL, set again on every turn.
func TestStrategySessionTTL(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	ae.setRouting(&configv1.ModelGroupRouting{SessionTtlMs: (2 * time.Minute).Milliseconds()})
	ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
	ae.waitPin("s1", ev.DeploymentId)
	key := ae.store.PinKey("o1", "g", "s1")
	ttl, err := ae.rdb.PTTL(context.Background(), key).Result()
	require.NoError(t, err)
	require.Greater(t, ttl, time.Minute)
	require.LessOrEqual(t, ttl, 2*time.Minute)
	require.NoError(t, ae.rdb.PExpire(context.Background(), key, 30*time.Second).Err())
	ae.call(chatBody("g", ""), "x-session-id", "s1")
	waitFor(t, "the pin's TTL set again", func() bool {
		ttl, _ := ae.rdb.PTTL(context.Background(), key).Result()
		return ttl > time.Minute
	})
}

// The group's load_factor is the bound of bounded-load rendezvous: with
// three requests of other proxies in flight at the prefix's replica, the
// default c = 1.25 skips it, c = 10 keeps it.
func TestStrategyLoadFactor(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyAffinity})
	first := ae.call(longPrefixBody("q"))
	require.Equal(t, reasonPrefix, first.RoutingReason)
	held := ae.hold(first.DeploymentId, 3, 16)
	ev := ae.call(longPrefixBody("q"))
	require.NotEqual(t, first.DeploymentId, ev.DeploymentId)
	require.Equal(t, reasonLoad, ev.RoutingReason)
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyAffinity, LoadFactor: 10})
	ev = ae.call(longPrefixBody("q"))
	require.Equal(t, first.DeploymentId, ev.DeploymentId)
	require.Equal(t, reasonPrefix, ev.RoutingReason)
	ae.release(held)
	ae.drained()
}

// least_outstanding goes to the deployment with the fewest fleet-wide
// requests in flight (leases of other proxies count); a cancelled request
// leaves no lease behind.
func TestStrategyLeastOutstanding(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyLeastOutstanding})
	held := ae.hold("d1", 2, 16)
	for range 6 {
		ev := ae.call(chatBody("g", ""), "x-session-id", "ignored")
		require.Equal(t, "d2", ev.DeploymentId)
		require.Equal(t, reasonLoad, ev.RoutingReason)
	}
	ae.release(held)
	held = ae.hold("d2", 2, 16)
	for range 6 {
		require.Equal(t, "d1", ae.call(chatBody("g", "")).DeploymentId)
	}
	ae.release(held)
	require.Empty(t, ae.pin("ignored"), "least_outstanding pins no session")

	// Cancelled mid-stream: the lease goes with the request.
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ae.srv.URL+"/v1/chat/completions",
		// ignore_eos: the simulator produces all 400 tokens, so the stream
		// outlives the lease count's scan of every master.
		strings.NewReader(`{"model":"g","stream":true,"max_tokens":400,"ignore_eos":true,"messages":[{"role":"user","content":"long answer"}]}`))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+ae.tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	waitFor(t, "the stream's lease", func() bool { return ae.leases() > 0 })
	cancel()
	_ = resp.Body.Close()
	waitFor(t, "no lease left after the cancel", func() bool { return ae.leases() == 0 })
	ae.drained()
}

// engine_load weighs a fresh engine sample (running + waiting) and falls
// back to the fleet-wide in-flight count once the sample is older than
// the maximum age; either way dispatch goes on.
func TestStrategyEngineLoadOrder(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) { d.MaxConcurrency = 16 })
	ae.setRouting(&configv1.ModelGroupRouting{Strategy: strategyEngineLoad})
	store := func(id string, s upstream.EngineSample) {
		ae.h.states.Get(id).Engine.Store(s)
	}
	store("d1", upstream.EngineSample{Running: 12, Waiting: 4, At: time.Now().Add(time.Hour)})
	store("d2", upstream.EngineSample{Running: 1, At: time.Now().Add(time.Hour)})
	for range 5 {
		ev := ae.call(chatBody("g", ""))
		require.Equal(t, "d2", ev.DeploymentId)
		require.Equal(t, reasonLoad, ev.RoutingReason)
	}
	// A frozen page claiming d2 idle does not hide what the proxies sent:
	// leases on d2 count.
	store("d1", upstream.EngineSample{Running: 0, At: time.Now().Add(time.Hour)})
	store("d2", upstream.EngineSample{Running: 0, At: time.Now().Add(time.Hour)})
	held := ae.hold("d2", 3, 16)
	for range 5 {
		require.Equal(t, "d1", ae.call(chatBody("g", "")).DeploymentId)
	}
	ae.release(held)
	// Stale samples are ignored: the in-flight count decides.
	store("d1", upstream.EngineSample{Running: 0, At: time.Now().Add(-time.Hour)})
	store("d2", upstream.EngineSample{Running: 50, At: time.Now().Add(-time.Hour)})
	held = ae.hold("d1", 2, 16)
	for range 5 {
		require.Equal(t, "d2", ae.call(chatBody("g", "")).DeploymentId, "a stale sample must not steer")
	}
	ae.release(held)
	require.Positive(t, counterValue(ae.h.em.engineLoad.WithLabelValues("stale")))
	ae.drained()
}

// A pin to a deployment outside the key's tag pool is never used (the
// request succeeds in its pool) and is kept for the session's requests
// whose pool holds it.
func TestSessionPinOutsidePool(t *testing.T) {
	ae := newAffinityEnv(t, func(d *configv1.Deployment) {
		if d.Id == "d2" {
			d.Tags = []string{"gpu"}
		}
	})
	require.NoError(t, ae.store.Pin(context.Background(), ae.store.PinKey("o1", "g", "s1"), "d1", time.Hour))
	ae.snap.Keys[0].Tags = []string{"gpu"}
	ae.apply()
	for range 5 {
		ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
		require.Equal(t, "d2", ev.DeploymentId, "the pool's deployment")
	}
	require.Equal(t, "d1", ae.pin("s1"), "the pin is kept")
	ae.snap.Keys[0].Tags = nil // the default pool: d1
	ae.apply()
	ev := ae.call(chatBody("g", ""), "x-session-id", "s1")
	require.Equal(t, "d1", ev.DeploymentId)
	require.Equal(t, reasonSession, ev.RoutingReason)
}

// TestRoutingSettingsEnforced lists every field of the snapshot's
// ModelGroupRouting and the test that proves it steers requests; a field
// added without one fails here (no dead settings).
func TestRoutingSettingsEnforced(t *testing.T) {
	proved := map[string]string{
		"strategy":       "TestStrategyDefaultsByClass, TestStrategyLeastOutstanding, TestStrategyEngineLoadOrder",
		"session_ttl_ms": "TestStrategySessionTTL",
		"load_factor":    "TestStrategyLoadFactor",
	}
	fields := (&configv1.ModelGroupRouting{}).ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		name := string(fields.Get(i).Name())
		require.Contains(t, proved, name, "ModelGroupRouting.%s has no test proving it is enforced", name)
	}
	require.Len(t, proved, fields.Len())
}
