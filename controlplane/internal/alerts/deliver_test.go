package alerts

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
)

// testKEK seals webhook secrets in these tests (base64 of 32 bytes).
const testKEK = "1:YWxlcnRzLXRlc3Qta2VrLTAxMjM0NTY3ODlhYmNkZWY="

// receiver is a webhook endpoint on loopback that fails the first
// failFirst attempts of every delivery id (answering 500), verifies every
// request's signature, and processes each delivery id once (a repeated id
// is acknowledged and dropped, as Standard Webhooks receivers do).
type receiver struct {
	t         *testing.T
	secret    string
	failFirst int
	srv       *httptest.Server

	mu        sync.Mutex
	attempts  map[string]int // by webhook-id
	processed map[string]int // by alert id: times processed after de-duplication
	done      map[string]bool
	badSig    int
	bodies    map[string]map[string]any
}

func newReceiver(t *testing.T, secret string, failFirst int) *receiver {
	r := &receiver{t: t, secret: secret, failFirst: failFirst, attempts: map[string]int{}, processed: map[string]int{},
		done: map[string]bool{}, bodies: map[string]map[string]any{}}
	r.srv = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.srv.Close)
	return r
}

func (r *receiver) serve(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	id := req.Header.Get(HeaderID)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := Verify(r.secret, id, req.Header.Get(HeaderTimestamp), req.Header.Get(HeaderSignature), body); err != nil {
		r.badSig++
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	r.attempts[id]++
	if r.failFirst < 0 || r.attempts[id] <= r.failFirst {
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	if r.done[id] {
		w.WriteHeader(http.StatusOK) // a repeat: acknowledged, not processed again
		return
	}
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	data, _ := m["data"].(map[string]any)
	alertID, _ := data["alert_id"].(string)
	r.done[id] = true
	r.processed[alertID]++
	r.bodies[alertID] = m
	w.WriteHeader(http.StatusNoContent)
}

func (r *receiver) processedCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.processed)
}

func newSecret(t *testing.T) string {
	var b [32]byte
	_, err := rand.Read(b[:])
	require.NoError(t, err)
	return SecretPrefix + base64.StdEncoding.EncodeToString(b[:])
}

// addWebhook stores an org (if new) and a webhook of it at url with
// secret, sealed by ring.
func (b *bundle) addWebhook(ring *keyring.Ring, org, id, url, secret string) {
	b.t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO orgs (id, name, created_at, updated_at) VALUES ($1, $1, now(), now()) ON CONFLICT DO NOTHING`, org)
	require.NoError(b.t, err)
	err = b.st.Mutate(ctx, store.Actor{ID: "test"}, func(tx *store.Tx) error {
		if err := tx.WebhookInsert(ctx, &store.Webhook{ID: id, OrgID: org, URL: url, SecretCiphertext: ring.Seal([]byte(secret)), CreatedBy: "test"}); err != nil {
			return err
		}
		return tx.Audit(ctx, "created", "alert_webhook", id, org, "", nil, []byte(`{}`))
	})
	require.NoError(b.t, err)
}

func startDeliverer(t *testing.T, st *store.Store, ring *keyring.Ring, maxAttempts int) *Deliverer {
	d := NewDeliverer(DeliveryConfig{PollInterval: 20 * time.Millisecond, BaseBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		AttemptTimeout: 5 * time.Second, MaxAttempts: maxAttempts, Open: ring.Open,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, st)
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(ctx) }()
	t.Cleanup(func() { stop(); <-done })
	return d
}

// TestWebhookDeliveryRetriesUntilDelivered: alerts published as data
// planes publish them reach the org's webhook through a receiver that
// fails every delivery twice: each alert is processed exactly once, every
// request is signed with the webhook's secret, each delivery took three
// attempts with one delivery id, and another org's webhook gets nothing.
func TestWebhookDeliveryRetriesUntilDelivered(t *testing.T) {
	t.Parallel()
	b, c := setup(t)
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	secret := newSecret(t)
	rcv := newReceiver(t, secret, 2)
	other := newReceiver(t, newSecret(t), 0)
	b.addWebhook(ring, "org_a", "whk_a", rcv.srv.URL+"/hook", secret)
	b.addWebhook(ring, "org_b", "whk_b", other.srv.URL+"/hook", other.secret)
	d := startDeliverer(t, b.st, ring, DefaultMaxAttempts)

	const n = 6
	for i := range n {
		b.publishAlert(alert(i), alert(i).AlertId)
	}
	// The same alert again from another data plane: recorded once, so
	// delivered once.
	b.publishAlert(alert(0), "copy-"+alert(0).AlertId)
	require.Eventually(t, func() bool { s := c.Stats(); return s.Recorded+s.Duplicates == n+1 }, 15*time.Second, 20*time.Millisecond)
	require.Eventually(t, func() bool { return rcv.processedCount() == n }, 30*time.Second, 20*time.Millisecond)

	ctx := context.Background()
	var deliveries []store.Delivery
	require.Eventually(t, func() bool {
		deliveries, err = b.st.DeliveryList(ctx, store.DeliveryQuery{OrgID: "org_a"}, 100)
		require.NoError(t, err)
		for _, dl := range deliveries {
			if dl.State != store.DeliveryDelivered {
				return false
			}
		}
		return len(deliveries) == n
	}, 10*time.Second, 20*time.Millisecond)

	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	require.Zero(t, rcv.badSig, "every request carries a valid signature")
	for i := range n {
		a := alert(i)
		require.Equal(t, 1, rcv.processed[a.AlertId], "alert %s processed exactly once", a.AlertId)
		data := rcv.bodies[a.AlertId]["data"].(map[string]any)
		require.Equal(t, "org_a", data["org_id"])
		require.Equal(t, float64(a.ThresholdPercent), data["threshold_percent"])
		require.Equal(t, "budget.threshold", rcv.bodies[a.AlertId]["type"])
	}
	for _, dl := range deliveries {
		require.Equal(t, 3, dl.Attempts, "delivery %s: two failures, then the success", dl.ID)
		require.Equal(t, 3, rcv.attempts[dl.ID], "delivery %s: one id for every attempt", dl.ID)
		require.NotNil(t, dl.DeliveredAt)
		require.Empty(t, dl.LastError)
	}
	require.Len(t, rcv.attempts, n, "one delivery id per alert")
	require.Zero(t, other.processedCount(), "org_b's webhook gets none of org_a's alerts")
	require.Equal(t, uint64(n), d.Stats().Delivered)
	require.Equal(t, uint64(2*n), d.Stats().Failed)
}

// TestWebhookDeadLetter: a receiver that always fails sends the delivery
// to the dead-letter list after MaxAttempts, with its last error; a retry
// after the receiver recovers delivers it with the same delivery id.
func TestWebhookDeadLetter(t *testing.T) {
	t.Parallel()
	b, _ := setup(t)
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	secret := newSecret(t)
	rcv := newReceiver(t, secret, -1) // always 500
	b.addWebhook(ring, "org_a", "whk_a", rcv.srv.URL, secret)
	startDeliverer(t, b.st, ring, 3)
	b.publishAlert(alert(1), alert(1).AlertId)

	ctx := context.Background()
	var dead []store.Delivery
	require.Eventually(t, func() bool {
		dead, err = b.st.DeliveryList(ctx, store.DeliveryQuery{OrgID: "org_a", State: store.DeliveryDead}, 10)
		require.NoError(t, err)
		return len(dead) == 1
	}, 30*time.Second, 20*time.Millisecond)
	require.Equal(t, 3, dead[0].Attempts)
	require.Equal(t, "HTTP 500", dead[0].LastError)
	rcv.mu.Lock()
	require.Equal(t, 3, rcv.attempts[dead[0].ID], "no attempt after the last")
	rcv.failFirst = 0 // the receiver recovers
	rcv.mu.Unlock()

	err = b.st.Mutate(ctx, store.Actor{ID: "test"}, func(tx *store.Tx) error {
		d, err := tx.DeliveryGet(ctx, store.Tenant{OrgID: "org_a"}, dead[0].ID)
		if err != nil {
			return err
		}
		if err := tx.DeliveryRetry(ctx, &d); err != nil {
			return err
		}
		return tx.Audit(ctx, "updated", "alert_delivery", d.ID, d.OrgID, "", nil, []byte(`{}`))
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return rcv.processedCount() == 1 }, 30*time.Second, 20*time.Millisecond)
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	require.Equal(t, 1, rcv.processed[alert(1).AlertId])
	require.Equal(t, 4, rcv.attempts[dead[0].ID], "the retry reuses the delivery id")
}

// TestSignature pins the signature format: HMAC-SHA256 over
// "<id>.<timestamp>.<body>" keyed by the decoded secret, "v1," and base64.
func TestSignature(t *testing.T) {
	t.Parallel()
	// The Standard Webhooks specification's example values.
	secret := "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
	key, err := SecretKey(secret)
	require.NoError(t, err)
	body := []byte(`{"test": 2432232314}`)
	sig := Sign(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body)
	require.Equal(t, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=", sig)
	require.NoError(t, Verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", "v1,bogus "+sig, body))
	require.Error(t, Verify(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265331", sig, body), "another timestamp")
	require.Error(t, Verify(secret, "msg_other", "1614265330", sig, body), "another id")
	_, err = SecretKey("not-a-secret")
	require.Error(t, err)
	require.Equal(t, time.Second, Backoff(1, time.Second, time.Hour).Truncate(time.Second))
	require.Equal(t, 8*time.Second, Backoff(4, time.Second, time.Hour).Truncate(time.Second))
	require.Equal(t, time.Hour, Backoff(40, time.Second, time.Hour).Truncate(time.Hour))
}

// TestWebhookRedeliveryKeepsItsID: a delivery claimed by a replica that
// died before recording anything is sent after its lease by another, and
// a delivery whose 2xx was lost (the answer came after the attempt
// timeout) is sent again: both with the same webhook-id, so a receiver
// that de-duplicates on it processes each alert once.
func TestWebhookRedeliveryKeepsItsID(t *testing.T) {
	t.Parallel()
	b, c := setup(t)
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	secret := newSecret(t)
	rcv := newReceiver(t, secret, 0)
	slow := map[string]bool{}
	var mu sync.Mutex
	inner := rcv.srv.Config.Handler
	rcv.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inner.ServeHTTP(w, r)
		mu.Lock()
		first := !slow[r.Header.Get(HeaderID)]
		slow[r.Header.Get(HeaderID)] = true
		mu.Unlock()
		if first {
			time.Sleep(600 * time.Millisecond) // processed, but the answer is too late
		}
	})
	b.addWebhook(ring, "org_a", "whk_a", rcv.srv.URL, secret)
	ctx := context.Background()
	b.publishAlert(alert(1), alert(1).AlertId)
	b.publishAlert(alert(2), alert(2).AlertId)
	require.Eventually(t, func() bool { return c.Stats().Recorded == 2 }, 15*time.Second, 20*time.Millisecond)

	// A replica claims both and dies: nothing is recorded.
	claimed, err := b.st.DeliveryClaim(ctx, 10, 300*time.Millisecond)
	require.NoError(t, err)
	require.Len(t, claimed, 2)

	d := NewDeliverer(DeliveryConfig{PollInterval: 20 * time.Millisecond, BaseBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
		AttemptTimeout: 300 * time.Millisecond, Open: ring.Open, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, b.st)
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(rctx) }()
	t.Cleanup(func() { stop(); <-done })

	require.Eventually(t, func() bool {
		dl, err := b.st.DeliveryList(ctx, store.DeliveryQuery{OrgID: "org_a", State: store.DeliveryDelivered}, 10)
		require.NoError(t, err)
		return len(dl) == 2
	}, 30*time.Second, 20*time.Millisecond)
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	require.Zero(t, rcv.badSig)
	for _, w := range claimed {
		require.Equal(t, 1, rcv.processed[w.Alert.AlertID], "alert %s processed once", w.Alert.AlertID)
		require.GreaterOrEqual(t, rcv.attempts[w.ID], 2, "delivery %s was sent again (its first answer was lost)", w.ID)
	}
	require.Len(t, rcv.attempts, 2, "the same two delivery ids throughout")
}
