package gateway

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/internal/testsvc"
)

// testCluster is the Redis Cluster of TestRoutingOnCluster's subtests.
var testCluster atomic.Pointer[testsvc.RedisCluster]

// onCluster returns the Redis Cluster a test under TestRoutingOnCluster
// runs on (nil: the machine's Redis).
func onCluster(t testing.TB) *testsvc.RedisCluster {
	if !strings.Contains(t.Name(), "/cluster/") {
		return nil
	}
	return testCluster.Load()
}

// TestRoutingOnCluster runs the routing tests on a 3-master Redis
// Cluster with the data plane's Cluster connection, limits and affinity
// sharing it, with the same assertions as on one Redis: session pins
// (kept after filters, across a full deployment, replaced when gone, with
// their TTL), prefix affinity, bounded load, least_outstanding and
// engine_load over the fleet-wide leases, prefill isolation. A session's pin lives on its
// org's slot and each deployment's leases on the deployment's own, so one
// lookup reads several nodes; the limits scripts' keys share one slot per
// call (a call touching two would fail with CROSSSLOT).
func TestRoutingOnCluster(t *testing.T) {
	testCluster.Store(testsvc.StartRedisCluster(t))
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"SessionAffinity", TestSessionAffinity}, {"SessionPinAfterFilters", TestSessionPinAfterFilters},
		{"SessionPinFull", TestSessionPinFull}, {"SessionPinGone", TestSessionPinGone},
		{"SessionPinOutsidePool", TestSessionPinOutsidePool}, {"PrefixAffinity", TestPrefixAffinity},
		{"StrategyDefaultsByClass", TestStrategyDefaultsByClass}, {"StrategySessionTTL", TestStrategySessionTTL},
		{"StrategyLoadFactor", TestStrategyLoadFactor}, {"StrategyLeastOutstanding", TestStrategyLeastOutstanding},
		{"StrategyEngineLoadOrder", TestStrategyEngineLoadOrder}, {"PinAndLoadsOnSeveralSlots", testPinAndLoadsOnSeveralSlots},
		{"NewSessionsBalanced", TestNewSessionsBalanced}, {"NewSessionFailedNotCounted", TestNewSessionFailedNotCounted},
		{"NewSessionCountedWhileFirstTurnRuns", TestNewSessionCountedWhileFirstTurnRuns},
		// The prefill isolation gate's keys on the group's own slot,
		// beside the deployments' lease slots.
		{"PrefillIsolation", TestPrefillIsolation},
	} {
		t.Run("cluster/"+tc.name, tc.f)
	}
}

// testPinAndLoadsOnSeveralSlots checks the premise of TestRoutingOnCluster:
// a session's pin and the deployments' lease keys hash to different
// slots, so the lookup really spans the Cluster.
func testPinAndLoadsOnSeveralSlots(t *testing.T) {
	ae := newAffinityEnv(t, nil)
	rc := onCluster(t)
	require.NotNil(t, rc)
	ctx := context.Background()
	slots := map[int64]bool{}
	for _, k := range []string{ae.store.PinKey("o1", "g", "s1"), ae.lim.DeploymentLeaseKey("d1"), ae.lim.DeploymentLeaseKey("d2")} {
		s, err := ae.rdb.ClusterKeySlot(ctx, k).Result()
		require.NoError(t, err)
		slots[s] = true
	}
	require.Len(t, slots, 3, "the pin and the two deployments' leases on three slots")
	require.NotEqual(t, limits.DeploymentOrg("d1"), "o1")
}
