package admin

import (
	"context"
	"math"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/sluicegw/sluice/controlplane/internal/configmsg"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// A model group's routing settings round-trip through create, get, list
// and update (masks on the whole message and on one field), are audited,
// and reach the snapshot's model group.
func TestModelGroupRouting(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	auditBefore := b.auditCount()
	want := &adminv1.ModelGroupRouting{Strategy: StrategyAffinity, SessionTtl: durationpb.New(90 * time.Minute), LoadFactor: 1.5}
	g, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "agents", Routing: want}))
	require.NoError(t, err)
	require.True(t, proto.Equal(want, g.Msg.ModelGroup.Routing), "%v", g.Msg.ModelGroup.Routing)
	got, err := m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "agents"}))
	require.NoError(t, err)
	require.True(t, proto.Equal(want, got.Msg.ModelGroup.Routing))
	require.Equal(t, auditBefore+1, b.auditCount())

	// One field by mask: the others stay.
	u, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "agents", Routing: &adminv1.ModelGroupRouting{LoadFactor: 2}}, UpdateMask: mask("routing.load_factor")}))
	require.NoError(t, err)
	require.Equal(t, 2.0, u.Msg.ModelGroup.Routing.GetLoadFactor())
	require.Equal(t, StrategyAffinity, u.Msg.ModelGroup.Routing.GetStrategy())
	require.Equal(t, auditBefore+2, b.auditCount())

	// The whole message: a load-aware strategy, the affinity settings gone.
	u, err = m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "agents", Routing: &adminv1.ModelGroupRouting{Strategy: StrategyEngineLoad}}, UpdateMask: mask("routing")}))
	require.NoError(t, err)
	require.True(t, proto.Equal(&adminv1.ModelGroupRouting{Strategy: StrategyEngineLoad}, u.Msg.ModelGroup.Routing))

	// The snapshot carries it.
	st, err := b.store.ModelGroupGet(ctx, "agents")
	require.NoError(t, err)
	cg, err := configmsg.ModelGroup(st)
	require.NoError(t, err)
	require.Equal(t, StrategyEngineLoad, cg.GetRouting().GetStrategy())

	// Cleared: the defaults, nothing in the snapshot.
	u, err = m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "agents"}, UpdateMask: mask("routing")}))
	require.NoError(t, err)
	require.Nil(t, u.Msg.ModelGroup.Routing)
	st, err = b.store.ModelGroupGet(ctx, "agents")
	require.NoError(t, err)
	cg, err = configmsg.ModelGroup(st)
	require.NoError(t, err)
	require.Nil(t, cg.GetRouting())

	// The snapshot's TTL is in milliseconds.
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "chat",
		Routing: &adminv1.ModelGroupRouting{SessionTtl: durationpb.New(2 * time.Hour)}}))
	require.NoError(t, err)
	st, err = b.store.ModelGroupGet(ctx, "chat")
	require.NoError(t, err)
	cg, err = configmsg.ModelGroup(st)
	require.NoError(t, err)
	require.Equal(t, int64(2*time.Hour/time.Millisecond), cg.GetRouting().GetSessionTtlMs())
}

// Invalid routing settings are InvalidArgument naming the field, on
// create and on update; nothing is written.
func TestModelGroupRoutingValidation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	b.mkModelGroup("g")
	for _, tc := range []struct {
		name  string
		r     *adminv1.ModelGroupRouting
		field string
	}{
		{"unknown strategy", &adminv1.ModelGroupRouting{Strategy: "round_robin"}, "routing.strategy:"},
		{"strategy case", &adminv1.ModelGroupRouting{Strategy: "Affinity"}, "routing.strategy:"},
		{"ttl short", &adminv1.ModelGroupRouting{SessionTtl: durationpb.New(time.Millisecond)}, "routing.session_ttl:"},
		{"ttl long", &adminv1.ModelGroupRouting{SessionTtl: durationpb.New(8 * 24 * time.Hour)}, "routing.session_ttl:"},
		{"ttl negative", &adminv1.ModelGroupRouting{SessionTtl: durationpb.New(-time.Hour)}, "routing.session_ttl:"},
		{"ttl invalid", &adminv1.ModelGroupRouting{SessionTtl: &durationpb.Duration{Seconds: 1, Nanos: -1}}, "routing.session_ttl:"},
		{"ttl without pins", &adminv1.ModelGroupRouting{Strategy: StrategyLeastOutstanding, SessionTtl: durationpb.New(time.Hour)}, "routing.session_ttl:"},
		{"ttl with shuffle", &adminv1.ModelGroupRouting{Strategy: StrategyWeightedShuffle, SessionTtl: durationpb.New(time.Hour)}, "routing.session_ttl:"},
		{"factor low", &adminv1.ModelGroupRouting{LoadFactor: 0.5}, "routing.load_factor:"},
		{"factor high", &adminv1.ModelGroupRouting{LoadFactor: 11}, "routing.load_factor:"},
		{"factor negative", &adminv1.ModelGroupRouting{LoadFactor: -1}, "routing.load_factor:"},
		{"factor NaN", &adminv1.ModelGroupRouting{LoadFactor: math.NaN()}, "routing.load_factor:"},
		{"factor without hashing", &adminv1.ModelGroupRouting{Strategy: StrategyEngineLoad, LoadFactor: 1.5}, "routing.load_factor:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "new", Routing: tc.r}))
			require.Equal(t, "invalid_argument", codeOf(err), "%v", err)
			require.Contains(t, err.Error(), tc.field)
			_, err = m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
				ModelGroup: &adminv1.ModelGroup{Name: "g", Routing: tc.r}, UpdateMask: mask("routing")}))
			require.Equal(t, "invalid_argument", codeOf(err), "%v", err)
			require.Contains(t, err.Error(), tc.field)
		})
	}
	_, err := m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "new"}))
	require.Equal(t, "not_found", codeOf(err))
	got, err := m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "g"}))
	require.NoError(t, err)
	require.Nil(t, got.Msg.ModelGroup.Routing)
	// An unknown field of the routing message is refused by the strict
	// JSON decoding of every RPC (TestStrictInput covers the decoder).
	_, err = m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "g"}, UpdateMask: mask("routing.strategy_name")}))
	require.Equal(t, "invalid_argument", codeOf(err))
}
