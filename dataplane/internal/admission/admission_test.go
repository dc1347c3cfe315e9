package admission

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/limits"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func TestDeploymentScopes(t *testing.T) {
	t.Parallel()
	tr := &configv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 1}
	all := limits.Scope{Kind: limits.KindDeployment, ID: "d", MaxParallel: 8}
	shared := limits.Scope{Kind: limits.KindDeployment, ID: "d#shared", MaxParallel: 6}
	batch := limits.Scope{Kind: limits.KindDeployment, ID: "d#batch", MaxParallel: 1}
	for _, tc := range []struct {
		c    configv1.TrafficClass
		tr   *configv1.DeploymentTraffic
		want []limits.Scope
	}{
		{configv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE, tr, []limits.Scope{all}},
		{configv1.TrafficClass_TRAFFIC_CLASS_AGENT, tr, []limits.Scope{all, shared}},
		{configv1.TrafficClass_TRAFFIC_CLASS_BATCH, tr, []limits.Scope{all, shared, batch}},
		{configv1.TrafficClass_TRAFFIC_CLASS_AGENT, nil, []limits.Scope{all}},
		{configv1.TrafficClass_TRAFFIC_CLASS_BATCH, &configv1.DeploymentTraffic{BatchMaxConcurrency: 3},
			[]limits.Scope{all, {Kind: limits.KindDeployment, ID: "d#batch", MaxParallel: 3}}},
	} {
		got, ok := DeploymentScopes("d", 8, tc.tr, tc.c)
		require.True(t, ok)
		require.Equal(t, tc.want, got, "%v", tc.c)
	}
	_, ok := DeploymentScopes("d", 2, &configv1.DeploymentTraffic{InteractiveReserve: 2}, configv1.TrafficClass_TRAFFIC_CLASS_AGENT)
	require.False(t, ok, "a reserve of every slot leaves agents nothing")
}

func TestInFlight(t *testing.T) {
	t.Parallel()
	var f InFlight
	require.Equal(t, int64(0), f.Acquire("k"))
	require.Equal(t, int64(1), f.Acquire("k"))
	f.Release("k")
	f.Release("k")
	require.Equal(t, int64(0), f.Peek("k"))
	require.Empty(t, f.n)
}
