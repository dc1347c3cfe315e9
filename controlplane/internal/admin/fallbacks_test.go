package admin

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestModelGroupFallbacksValidated: fallbacks name existing groups,
// never the group itself, and form no cycle (InvalidArgument naming the
// field and the group); a valid change is stored, returned, audited, and
// a group that is another's fallback cannot be deleted.
func TestModelGroupFallbacksValidated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	for _, g := range []string{"fa", "fb", "fc"} {
		b.mkModelGroup(g)
	}
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "fd", Fallbacks: []string{"nope"}}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `unknown model group "nope"`)
	_, err = m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "fd", Fallbacks: []string{"fd"}}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `cannot fall back to itself`)

	update := func(name string, fallbacks ...string) (*adminv1.ModelGroup, error) {
		r, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
			ModelGroup: &adminv1.ModelGroup{Name: name, Fallbacks: fallbacks}, UpdateMask: mask("fallbacks")}))
		if err != nil {
			return nil, err
		}
		return r.Msg.GetModelGroup(), nil
	}
	audits := b.auditCount()
	g, err := update("fa", "fb", "fc")
	require.NoError(t, err)
	require.Equal(t, []string{"fb", "fc"}, g.GetFallbacks())
	require.Equal(t, audits+1, b.auditCount(), "the change is audited")
	_, err = update("fb", "fc")
	require.NoError(t, err)
	_, err = update("fc", "fa")
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `the fallbacks form a cycle: fc → fa → fb → fc`)
	_, err = update("fa", "fb", "fb")
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `listed twice`)

	got, err := m.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "fa"}))
	require.NoError(t, err)
	require.Equal(t, []string{"fb", "fc"}, got.Msg.GetModelGroup().GetFallbacks())
	_, err = m.DeleteModelGroup(ctx, connect.NewRequest(&adminv1.DeleteModelGroupRequest{Name: "fc"}))
	require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err))
	require.Contains(t, err.Error(), "is a fallback of fa, fb")

	// Resilience settings: validated, stored, returned.
	_, err = m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "fa", Resilience: &adminv1.ModelGroupResilience{TtftTimeoutMs: 5, MaxAttempts: 11, EjectionBaseMs: 5000, EjectionMaxMs: 1000}},
		UpdateMask: mask("resilience")}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	for _, f := range []string{"resilience.ttft_timeout_ms", "resilience.max_attempts", "resilience.ejection_max_ms"} {
		require.Contains(t, err.Error(), f)
	}
	r, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "fa", Resilience: &adminv1.ModelGroupResilience{TtftTimeoutMs: 2000, MaxAttempts: 4, PanicThresholdPercent: 70}},
		UpdateMask: mask("resilience.ttft_timeout_ms", "resilience.max_attempts", "resilience.panic_threshold_percent")}))
	require.NoError(t, err)
	require.Equal(t, int64(2000), r.Msg.GetModelGroup().GetResilience().GetTtftTimeoutMs())
	require.Equal(t, []string{"fb", "fc"}, r.Msg.GetModelGroup().GetFallbacks(), "untouched by a resilience update")
}

// TestKeyAndTeamFallbackOverrides: overrides name existing groups and
// close no cycle with the groups' lists; stored and returned.
func TestKeyAndTeamFallbackOverrides(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	m := b.models(b.bootstrap)
	b.mkModelGroup("ka")
	b.mkModelGroup("kb")
	_, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "ka", Fallbacks: []string{"kb"}}, UpdateMask: mask("fallbacks")}))
	require.NoError(t, err)
	o := b.mkOrg("fallback-org")
	c := b.root()
	fb := func(g string, list ...string) map[string]*adminv1.ModelGroupFallbacks {
		return map[string]*adminv1.ModelGroupFallbacks{g: {ModelGroups: list}}
	}
	_, err = c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: o.GetId(), Fallbacks: fb("ka", "missing")}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), `fallbacks["ka"]`)
	require.Contains(t, err.Error(), `unknown model group "missing"`)
	_, err = c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: o.GetId(), Fallbacks: fb("kb", "ka")}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), "cycle: kb → ka → kb")
	k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: o.GetId(), Fallbacks: fb("kb")}))
	require.NoError(t, err)
	require.Contains(t, k.Msg.GetKey().GetFallbacks(), "kb")
	got, err := c.Key.GetKey(ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: k.Msg.GetKey().GetId()}))
	require.NoError(t, err)
	require.Empty(t, got.Msg.GetKey().GetFallbacks()["kb"].GetModelGroups(), "an empty list: fallbacks off")
	require.Contains(t, got.Msg.GetKey().GetFallbacks(), "kb")

	tm, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: o.GetId(), Name: "t"}))
	require.NoError(t, err)
	_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: tm.Msg.GetTeam().GetId(), Fallbacks: fb("ka", "ka")}, UpdateMask: mask("fallbacks")}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: tm.Msg.GetTeam().GetId(), Fallbacks: fb("kb", "ka")}, UpdateMask: mask("fallbacks")}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "kb → ka → kb")
	_, err = c.Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team: &adminv1.Team{Id: tm.Msg.GetTeam().GetId(), Fallbacks: fb("ka")}, UpdateMask: mask("fallbacks")}))
	require.NoError(t, err)
	gt, err := c.Team.GetTeam(ctx, connect.NewRequest(&adminv1.GetTeamRequest{Id: tm.Msg.GetTeam().GetId()}))
	require.NoError(t, err)
	require.Contains(t, gt.Msg.GetTeam().GetFallbacks(), "ka")
}
