package system

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/e2e/harness"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// verifyWebhook checks a request as a Standard Webhooks receiver does,
// from the documented format alone (docs/alerts.md): "v1," and the base64
// HMAC-SHA256, keyed by the secret's base64 part, of "<id>.<ts>.<body>".
func verifyWebhook(secret string, h http.Header, body []byte) bool {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		return false
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(h.Get("webhook-id") + "." + h.Get("webhook-timestamp") + "."))
	m.Write(body)
	want := "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
	for _, s := range strings.Fields(h.Get("webhook-signature")) {
		if hmac.Equal([]byte(s), []byte(want)) {
			return true
		}
	}
	return false
}

// TestBudgetAlertWebhooksEndToEnd: budget alerts a data plane raises reach
// the org's webhook through the real control plane (consumer, delivery
// outbox, deliverer with its default backoff): the receiver fails every
// delivery twice, then accepts; each alert is processed exactly once,
// every request is signed, and ListAlertDeliveries shows each delivered
// after three attempts.
func TestBudgetAlertWebhooksEndToEnd(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: &adminv1.Prices{InputPerToken: 0.5, OutputPerToken: 1}})) // $10 a request
	require.NoError(t, err)
	ten := d.NewTenant("hooks")

	var mu sync.Mutex
	attempts := map[string]int{}  // by webhook-id
	processed := map[string]int{} // by alert id, after de-duplication
	seen := map[string]bool{}     // webhook-ids processed
	thresholds := []float64{}     // threshold_percent of processed alerts
	badSig := 0
	var secret string
	rcv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		if !verifyWebhook(secret, r.Header, body) {
			badSig++
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		id := r.Header.Get("webhook-id")
		attempts[id]++
		if attempts[id] <= 2 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if !seen[id] {
			seen[id] = true
			var p struct {
				Data struct {
					AlertID          string  `json:"alert_id"`
					OrgID            string  `json:"org_id"`
					ThresholdPercent float64 `json:"threshold_percent"`
				} `json:"data"`
			}
			if json.Unmarshal(body, &p) == nil && p.Data.OrgID == ten.OrgID {
				processed[p.Data.AlertID]++
				thresholds = append(thresholds, p.Data.ThresholdPercent)
			}
		}
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(rcv.Close)

	tc := adminv1connect.NewAdminTokenServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	tk, err := tc.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{Name: "hooks", Scope: adminv1.Scope_SCOPE_ORG,
		Role: adminv1.Role_ROLE_EDITOR, OrgId: ten.OrgID}))
	require.NoError(t, err)
	orgAdmin := tk.Msg.Token
	ac := adminv1connect.NewAlertServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(orgAdmin)))
	wh, err := ac.CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: rcv.URL + "/sluice"}))
	require.NoError(t, err)
	mu.Lock()
	secret = wh.Msg.Secret
	mu.Unlock()

	soft, hard := 1.0, 25.0
	_, err = d.Clients().Key.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
		Key:        &adminv1.Key{Id: ten.KeyID, Limits: &adminv1.Limits{MaxBudget: &hard, SoftBudget: &soft, BudgetDuration: "1d"}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"limits"}}}))
	require.NoError(t, err)
	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool {
		pr, err := p.DP.Catalog().Authenticate(testPeppers(t), ten.Token, time.Now())
		return err == nil && pr.Key.GetLimits().GetMaxBudget() == hard && len(p.DP.Catalog().Deployments("m")) == 1
	}, 10*time.Second, 10*time.Millisecond)
	for i := range 3 { // spend 0 → 30: soft, 50, 85, 95, 100 %
		// A 503 (limits_recovering while a budget window is seeded from
		// the ledger, on a loaded machine) admitted nothing: ask again.
		var e openAIError
		harness.Eventually(t, func() bool {
			e = settingsPost(t, p, ten.Token, "", settingsBody)
			if e.status == http.StatusServiceUnavailable {
				t.Logf("request %d: 503 %s (%s); asking again", i, e.Error.Code, e.Error.Message)
			}
			return e.status != http.StatusServiceUnavailable
		}, 15*time.Second, 50*time.Millisecond, "request %d: %+v", i, e.Error)
		require.Equal(t, http.StatusOK, e.status, "request %d: %+v", i, e.Error)
		require.NoError(t, p.DP.Drain(ctx))
	}

	// Two failures each (1 s, then 2 s of backoff), then delivered.
	harness.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(processed) == 5
	}, 30*time.Second, 50*time.Millisecond, "every alert delivered")
	var dl []*adminv1.AlertDelivery
	harness.Eventually(t, func() bool {
		r, err := ac.ListAlertDeliveries(ctx, connect.NewRequest(&adminv1.ListAlertDeliveriesRequest{State: "delivered"}))
		require.NoError(t, err)
		dl = r.Msg.Deliveries
		return len(dl) == 5
	}, 10*time.Second, 50*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Zero(t, badSig, "every request is signed with the webhook's secret")
	for id, n := range processed {
		require.Equal(t, 1, n, "alert %s processed exactly once", id)
	}
	slices.Sort(thresholds)
	require.Equal(t, []float64{0, 50, 85, 95, 100}, thresholds)
	for _, x := range dl {
		require.EqualValues(t, 3, x.Attempts, "delivery %s", x.DeliveryId)
		require.Equal(t, 3, attempts[x.DeliveryId], "one webhook-id for all attempts of %s", x.DeliveryId)
		require.Equal(t, wh.Msg.Webhook.Id, x.WebhookId)
	}
}
