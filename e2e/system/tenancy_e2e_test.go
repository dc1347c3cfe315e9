package system

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// listModels returns the ids /v1/models on p lists for tok.
func listModels(t *testing.T, p *proxy, tok string) []string {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, p.URL+"/v1/models", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	var out struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal(b, &out))
	ids := []string{}
	for _, m := range out.Data {
		ids = append(ids, m.ID)
	}
	return ids
}

func chatBody(model string) string {
	return strings.Replace(settingsBody, `"m"`, `"`+model+`"`, 1)
}

// TestModelGroupGrants: model groups owned by tenants across two data
// planes. A new org sees and calls only the platform-wide groups and the
// groups granted to it; an ungranted group answers 404 model_not_found
// naming it, exactly like a group that does not exist. Revoking a grant
// stops the org's requests for the group on both data planes within 1 s
// of the RevokeModelGroup answer.
func TestModelGroupGrants(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	for _, g := range []struct {
		name     string
		platform bool
	}{{"shared", true}, {"private", false}, {"granted", false}} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g.name, PlatformWide: g.platform}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: g.name, ApiBase: up,
			UpstreamModel: "up", Weight: 1, Free: true}))
		require.NoError(t, err)
	}
	a, b := d.NewTenant("tenancy-a"), d.NewTenant("tenancy-b")
	_, err := m.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "granted", OrgId: a.OrgID}))
	require.NoError(t, err)

	proxies := []*proxy{d.StartProxy("default", time.Minute), d.StartProxy("default", time.Minute)}
	for _, p := range proxies {
		harness.Eventually(t, func() bool {
			c := p.DP.Catalog()
			return c.ModelGroupVisible(a.OrgID, "granted") && len(c.Deployments("private")) == 1 && len(c.Deployments("granted")) == 1 &&
				len(c.Deployments("shared")) == 1 && c.HasOrg(b.OrgID)
		}, 15*time.Second, 10*time.Millisecond, "the data plane never saw the groups and the grant")
	}

	for i, p := range proxies {
		require.Equal(t, []string{"granted", "shared"}, listModels(t, p, a.Token), "proxy %d, org a", i)
		require.Equal(t, []string{"shared"}, listModels(t, p, b.Token), "proxy %d, the new org b sees only platform-wide groups", i)
		require.Equal(t, http.StatusOK, settingsPost(t, p, a.Token, "", chatBody("granted")).status)
		require.Equal(t, http.StatusOK, settingsPost(t, p, a.Token, "", chatBody("shared")).status)
		require.Equal(t, http.StatusOK, settingsPost(t, p, b.Token, "", chatBody("shared")).status)
		for _, c := range []struct {
			tok, model string
		}{{a.Token, "private"}, {b.Token, "granted"}, {b.Token, "private"}, {b.Token, "no-such-group"}} {
			e := settingsPost(t, p, c.tok, "", chatBody(c.model))
			require.Equal(t, http.StatusNotFound, e.status, "proxy %d, %s", i, c.model)
			require.Equal(t, dataplane.CodeModelNotFound, e.Error.Code)
			require.Equal(t, "model", *e.Error.Param)
			require.Equal(t, `the model "`+c.model+`" does not exist or is not granted to this organization`, e.Error.Message,
				"an ungranted group answers like a missing one")
		}
	}

	// Org a calls the granted group on both proxies while it is revoked.
	_, err = m.RevokeModelGroup(ctx, connect.NewRequest(&adminv1.RevokeModelGroupRequest{ModelGroup: "granted", OrgId: a.OrgID}))
	require.NoError(t, err)
	revoked := time.Now()
	var wg sync.WaitGroup
	stopped := make([]time.Duration, len(proxies))
	for i, p := range proxies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			harness.Until(func() bool {
				if settingsPost(t, p, a.Token, "", chatBody("granted")).status == http.StatusNotFound {
					stopped[i] = time.Since(revoked)
					return true
				}
				return false
			}, 5*time.Second, 5*time.Millisecond)
		}()
	}
	wg.Wait()
	for i, s := range stopped {
		t.Logf("proxy %d refused the revoked group %s after RevokeModelGroup answered", i, s)
		require.NotZero(t, s, "proxy %d never refused the revoked group", i)
		require.Less(t, s, time.Second, "proxy %d: a revocation stops requests within 1 s", i)
	}
	for i, p := range proxies {
		for range 5 {
			require.Equal(t, http.StatusNotFound, settingsPost(t, p, a.Token, "", chatBody("granted")).status, "proxy %d stays refused", i)
		}
		require.False(t, slices.Contains(listModels(t, p, a.Token), "granted"), "proxy %d: /v1/models drops it", i)
		require.Equal(t, http.StatusOK, settingsPost(t, p, a.Token, "", chatBody("shared")).status, "proxy %d: other groups unaffected", i)
	}
}
