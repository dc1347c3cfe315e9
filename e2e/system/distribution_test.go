package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func TestKeyLifecycleReachesDataPlanes(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	c := d.Clients()
	ten := d.NewTenant("acme")
	p1 := d.StartProxy("default", time.Minute)
	p2 := d.StartProxy("default", time.Minute)
	for _, p := range []*proxy{p1, p2} {
		harness.WaitStatus(t, p, ten.Token, http.StatusOK, 5*time.Second)
		got, code := harness.Check(t, p, "sk-sluice-not-a-real-token")
		require.Equal(t, http.StatusUnauthorized, got)
		require.Equal(t, "invalid_api_key", code)
	}

	// Block at each level: the typed code names the scope.
	for _, lvl := range []struct {
		code           string
		block, unblock func() error
	}{
		{"key_blocked", func() error {
			_, err := c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: ten.KeyID}))
			return err
		}, func() error {
			_, err := c.Key.UnblockKey(ctx, connect.NewRequest(&adminv1.UnblockKeyRequest{Id: ten.KeyID}))
			return err
		}},
		{"user_blocked", func() error {
			_, err := c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: ten.UserID}))
			return err
		}, func() error {
			_, err := c.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: ten.UserID}))
			return err
		}},
		{"team_blocked", func() error {
			_, err := c.Team.BlockTeam(ctx, connect.NewRequest(&adminv1.BlockTeamRequest{Id: ten.TeamID}))
			return err
		}, func() error {
			_, err := c.Team.UnblockTeam(ctx, connect.NewRequest(&adminv1.UnblockTeamRequest{Id: ten.TeamID}))
			return err
		}},
		{"org_blocked", func() error {
			_, err := c.Org.BlockOrg(ctx, connect.NewRequest(&adminv1.BlockOrgRequest{Id: ten.OrgID}))
			return err
		}, func() error {
			_, err := c.Org.UnblockOrg(ctx, connect.NewRequest(&adminv1.UnblockOrgRequest{Id: ten.OrgID}))
			return err
		}},
	} {
		require.NoError(t, lvl.block())
		for _, p := range []*proxy{p1, p2} {
			harness.WaitStatus(t, p, ten.Token, http.StatusForbidden, time.Second)
			_, code := harness.Check(t, p, ten.Token)
			require.Equal(t, lvl.code, code)
		}
		require.NoError(t, lvl.unblock())
		for _, p := range []*proxy{p1, p2} {
			harness.WaitStatus(t, p, ten.Token, http.StatusOK, 2*time.Second)
		}
	}

	// Rotation with grace: both tokens work; without grace: the old one
	// stops at once.
	r1, err := c.Key.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: ten.KeyID, GracePeriod: "1h"}))
	require.NoError(t, err)
	harness.WaitStatus(t, p1, r1.Msg.Token, http.StatusOK, 2*time.Second)
	got, _ := harness.Check(t, p1, ten.Token)
	require.Equal(t, http.StatusOK, got, "old token valid during grace")
	r2, err := c.Key.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	for _, p := range []*proxy{p1, p2} {
		harness.WaitStatus(t, p, r2.Msg.Token, http.StatusOK, 2*time.Second)
		harness.WaitStatus(t, p, r1.Msg.Token, http.StatusUnauthorized, time.Second)
		harness.WaitStatus(t, p, ten.Token, http.StatusUnauthorized, time.Second)
	}

	// Deletion.
	_, err = c.Key.DeleteKey(ctx, connect.NewRequest(&adminv1.DeleteKeyRequest{Id: ten.KeyID}))
	require.NoError(t, err)
	for _, p := range []*proxy{p1, p2} {
		harness.WaitStatus(t, p, r2.Msg.Token, http.StatusUnauthorized, time.Second)
	}

	// The fleet view lists both instances.
	harness.Eventually(t, func() bool {
		resp, err := c.Fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
		return err == nil && len(resp.Msg.DataPlanes) == 2 && resp.Msg.DataPlanes[0].Health == "ok"
	}, 5*time.Second, 50*time.Millisecond)
}
