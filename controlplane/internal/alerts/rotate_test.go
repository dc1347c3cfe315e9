package alerts

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
)

// twoSecretReceiver accepts every request and records, per request, which
// of two secrets its signature header verifies with.
type twoSecretReceiver struct {
	old, cur string
	mu       sync.Mutex
	seen     [][2]bool // {old verifies, new verifies}
}

func (r *twoSecretReceiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	id, ts, sig := req.Header.Get(HeaderID), req.Header.Get(HeaderTimestamp), req.Header.Get(HeaderSignature)
	r.mu.Lock()
	r.seen = append(r.seen, [2]bool{Verify(r.old, id, ts, sig, body) == nil, Verify(r.cur, id, ts, sig, body) == nil})
	r.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

func (r *twoSecretReceiver) requests() [][2]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([][2]bool(nil), r.seen...)
}

// TestWebhookSecretRotationGrace: after a rotation with a grace period,
// every request is signed with both the new and the previous secret (a
// receiver holding either verifies it) until the grace ends; from then on
// with the new secret alone. A rotation without grace drops the previous
// secret at once.
func TestWebhookSecretRotationGrace(t *testing.T) {
	t.Parallel()
	b, c := setup(t)
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	oldSecret, newSecret2 := newSecret(t), newSecret(t)
	rcv := &twoSecretReceiver{old: oldSecret, cur: newSecret2}
	srv := httptest.NewServer(rcv)
	t.Cleanup(srv.Close)
	b.addWebhook(ring, "org_a", "whk_r", srv.URL, oldSecret)

	ctx := context.Background()
	rotate := func(secret string, until *time.Time) {
		t.Helper()
		require.NoError(t, b.st.Mutate(ctx, store.Actor{ID: "test"}, func(tx *store.Tx) error {
			w, err := tx.WebhookGetForUpdate(ctx, store.Tenant{}, "whk_r")
			if err != nil {
				return err
			}
			if err := tx.WebhookRotate(ctx, &w, ring.Seal([]byte(secret)), until); err != nil {
				return err
			}
			return tx.Audit(ctx, "rotated", "alert_webhook", w.ID, w.OrgID, "", nil, []byte(`{}`))
		}))
	}
	graceEnd := time.Now().Add(time.Hour)
	rotate(newSecret2, &graceEnd)

	// The deliverer's clock: now, then (offset) past the grace.
	var offset atomic.Int64
	d := NewDeliverer(DeliveryConfig{PollInterval: 20 * time.Millisecond, AttemptTimeout: 5 * time.Second, Open: ring.Open,
		Now:    func() time.Time { return time.Now().Add(time.Duration(offset.Load())) },
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, b.st)
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = d.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })

	deliver := func(i int) [2]bool {
		t.Helper()
		before := len(rcv.requests())
		b.publishAlert(alert(i), alert(i).AlertId)
		require.Eventually(t, func() bool { return len(rcv.requests()) == before+1 }, 15*time.Second, 20*time.Millisecond)
		return rcv.requests()[before]
	}
	require.Equal(t, [2]bool{true, true}, deliver(0), "during the grace both secrets verify")
	offset.Store(int64(2 * time.Hour))
	require.Equal(t, [2]bool{false, true}, deliver(1), "after the grace only the new secret verifies")
	offset.Store(0)
	require.Equal(t, [2]bool{true, true}, deliver(2), "the grace is the previous secret's window, not a one-way switch")

	// Rotating without grace: the newest secret alone, at once.
	third := newSecret(t)
	rotate(third, nil)
	rcv.mu.Lock()
	rcv.old, rcv.cur = newSecret2, third
	rcv.mu.Unlock()
	require.Equal(t, [2]bool{false, true}, deliver(3), "without grace the previous secret no longer signs")
	require.Eventually(t, func() bool { return c.Stats().Recorded == 4 }, 5*time.Second, 20*time.Millisecond)
}
