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
