package admin

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func TestOrgLifecycle(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()

	created, err := c.Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{
		Name:   "acme",
		Limits: &adminv1.Limits{MaxBudget: proto.Float64(100), BudgetDuration: "30d", RpmLimit: proto.Int64(600)},
	}))
	require.NoError(t, err)
	org := created.Msg.Org
	require.True(t, strings.HasPrefix(org.Id, "org_"))

	_, err = c.Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: "acme"}))
	require.Equal(t, "already_exists", codeOf(err))

	upd, err := c.Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{
		Org:        &adminv1.Org{Id: org.Id, Limits: &adminv1.Limits{RpmLimit: proto.Int64(1200)}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits.rpm_limit"}},
	}))
	require.NoError(t, err)
	require.Equal(t, int64(1200), upd.Msg.Org.Limits.GetRpmLimit())
	require.Equal(t, 100.0, upd.Msg.Org.Limits.GetMaxBudget(), "fields outside the mask are kept")

	_, err = c.Org.UpdateOrg(ctx, connect.NewRequest(&adminv1.UpdateOrgRequest{
		Org: &adminv1.Org{Id: org.Id}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"blocked"}},
	}))
	require.Equal(t, "invalid_argument", codeOf(err))

	bl, err := c.Org.BlockOrg(ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: org.Id}))
	require.NoError(t, err)
	require.True(t, bl.Msg.Org.Blocked)

	list, err := c.Org.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{Blocked: proto.Bool(true)}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Orgs, 1)

	_, err = c.Org.DeleteOrg(ctx, connect.NewRequest(&adminv1.DeleteOrgRequest{Id: org.Id}))
	require.NoError(t, err)
	_, err = c.Org.GetOrg(ctx, connect.NewRequest(&adminv1.GetOrgRequest{Id: org.Id}))
	require.Equal(t, "not_found", codeOf(err))
	require.Equal(t, int64(4), b.auditCount(), "create, update, block, delete; failed calls write nothing")
}

func TestListOrgsPaginates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		b.mkOrg(n)
	}
	var names []string
	tok := ""
	for {
		resp, err := b.root().Org.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{PageSize: 2, PageToken: tok}))
		require.NoError(t, err)
		for _, o := range resp.Msg.Orgs {
			names = append(names, o.Name)
		}
		if tok = resp.Msg.NextPageToken; tok == "" {
			break
		}
	}
	require.Equal(t, []string{"a", "b", "c", "d", "e"}, names)
	_, err := b.root().Org.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{PageSize: 501}))
	require.Equal(t, "invalid_argument", codeOf(err))
	_, err = b.root().Org.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{PageToken: "!!"}))
	require.Equal(t, "invalid_argument", codeOf(err))
}

func TestLimitValidationNamesTheField(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	cases := []struct {
		field  string
		limits *adminv1.Limits
	}{
		{"limits.max_budget", &adminv1.Limits{MaxBudget: proto.Float64(-1), BudgetDuration: "30d"}},
		{"limits.max_budget", &adminv1.Limits{MaxBudget: proto.Float64(0), BudgetDuration: "30d"}},
		{"limits.max_budget", &adminv1.Limits{MaxBudget: proto.Float64(1e12), BudgetDuration: "30d"}},
		{"limits.budget_duration", &adminv1.Limits{MaxBudget: proto.Float64(10)}},
		{"limits.budget_duration", &adminv1.Limits{MaxBudget: proto.Float64(10), BudgetDuration: "5x"}},
		{"limits.budget_duration", &adminv1.Limits{MaxBudget: proto.Float64(10), BudgetDuration: "400d"}},
		{"limits.soft_budget", &adminv1.Limits{SoftBudget: proto.Float64(-3), BudgetDuration: "1d"}},
		{"limits.soft_budget", &adminv1.Limits{MaxBudget: proto.Float64(10), SoftBudget: proto.Float64(20), BudgetDuration: "1d"}},
		{"limits.rpm_limit", &adminv1.Limits{RpmLimit: proto.Int64(0)}},
		{"limits.rpm_limit", &adminv1.Limits{RpmLimit: proto.Int64(-5)}},
		{"limits.tpm_limit", &adminv1.Limits{TpmLimit: proto.Int64(0)}},
		{"limits.max_parallel_requests", &adminv1.Limits{MaxParallelRequests: proto.Int64(-1)}},
		{"limits.max_parallel_requests", &adminv1.Limits{MaxParallelRequests: proto.Int64(10_000_000)}},
		{"limits.allowed_models[1]", &adminv1.Limits{AllowedModels: []string{"a", ""}}},
		{"limits.allowed_models[1]", &adminv1.Limits{AllowedModels: []string{"a", "a"}}},
		{"limits.model_max_budget", &adminv1.Limits{ModelMaxBudget: map[string]float64{"m": 1}, BudgetDuration: "1d"}},
		{"limits.model_rpm_limit", &adminv1.Limits{ModelRpmLimit: map[string]int64{"m": 1}}},
		{"limits.model_tpm_limit", &adminv1.Limits{ModelTpmLimit: map[string]int64{"m": 1}}},
	}
	for _, tc := range cases {
		_, err := b.root().Org.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: "x", Limits: tc.limits}))
		require.Equal(t, "invalid_argument", codeOf(err), "%s: %v", tc.field, tc.limits)
		require.Contains(t, connect.CodeOf(err).String()+": "+err.Error(), tc.field+":", "%v", tc.limits)
	}
	require.Equal(t, int64(0), b.auditCount(), "rejected requests change nothing")
}
