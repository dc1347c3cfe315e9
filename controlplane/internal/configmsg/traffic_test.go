package configmsg

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func adminJSON(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	require.NoError(t, err)
	return b
}

// Traffic settings stored as the admin messages' JSON reach the snapshot
// as the config messages, field for field; "{}" publishes nothing.
func TestTrafficSettingsConvert(t *testing.T) {
	t.Parallel()
	i32 := func(v int32) *int32 { return &v }
	org := &adminv1.OrgTraffic{
		DefaultClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		Rules: []*adminv1.ClassificationRule{{Header: "User-Agent", Pattern: "^claude-code/",
			TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT}},
		Demotion: &adminv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
	}
	om, err := Org(store.Org{ID: "org_1", Traffic: adminJSON(t, org)})
	require.NoError(t, err)
	want := &configv1.OrgTraffic{
		DefaultClass: configv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		Rules: []*configv1.ClassificationRule{{Header: "User-Agent", Pattern: "^claude-code/",
			TrafficClass: configv1.TrafficClass_TRAFFIC_CLASS_AGENT}},
		Demotion: &configv1.Demotion{MaxPromptTokens: 8000, MaxInteractiveInFlightPerKey: 1},
	}
	require.True(t, proto.Equal(want, om.Traffic), "got %v", om.Traffic)

	dep := &adminv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 3, MaxPrefillTokensInFlight: 16384,
		PriorityScheduling: true, ClassPriority: &adminv1.ClassPriorities{Interactive: i32(0), Agent: i32(5)},
		Queues: []*adminv1.ClassQueue{{TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_BATCH, MaxLength: 10, TimeoutMs: 500}}}
	dm, err := Deployment(store.Deployment{ID: "dep_1", Traffic: adminJSON(t, dep)})
	require.NoError(t, err)
	wantDep := &configv1.DeploymentTraffic{InteractiveReserve: 2, BatchMaxConcurrency: 3, MaxPrefillTokensInFlight: 16384,
		PriorityScheduling: true, ClassPriority: &configv1.ClassPriorities{Interactive: i32(0), Agent: i32(5)},
		Queues: []*configv1.ClassQueue{{TrafficClass: configv1.TrafficClass_TRAFFIC_CLASS_BATCH, MaxLength: 10, TimeoutMs: 500}}}
	require.True(t, proto.Equal(wantDep, dm.Traffic), "got %v", dm.Traffic)
	require.NotNil(t, dm.Traffic.ClassPriority.Interactive, "an explicit 0 priority survives")

	gm, err := ModelGroup(store.ModelGroup{Name: "g", Traffic: adminJSON(t, &adminv1.ModelGroupTraffic{
		Queues:           []*adminv1.ClassQueue{{TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT, MaxLength: 7}},
		PrefillIsolation: 1})})
	require.NoError(t, err)
	require.Equal(t, int64(7), gm.Traffic.Queues[0].MaxLength)
	require.Equal(t, int64(1), gm.Traffic.PrefillIsolation, "prefill isolation reaches the snapshot")

	for _, empty := range [][]byte{nil, []byte("{}")} {
		om, err := Org(store.Org{ID: "org_2", Traffic: empty})
		require.NoError(t, err)
		require.Nil(t, om.Traffic)
		dm, err := Deployment(store.Deployment{ID: "dep_2", Traffic: empty})
		require.NoError(t, err)
		require.Nil(t, dm.Traffic)
	}
	_, err = Org(store.Org{ID: "org_3", Traffic: []byte(`{"rules":"nope"}`)})
	require.ErrorContains(t, err, "org org_3: convert traffic settings")
}
