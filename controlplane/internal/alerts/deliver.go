package alerts

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sluicegw/sluice/controlplane/internal/store"
)

// Webhook delivery (docs/alerts.md#webhooks). Every recorded alert gets
// one alert_deliveries row per webhook of its org, written in the
// transaction that records the alert (store.AlertRecord): the outbox.
// Every control-plane replica runs a Deliverer: it claims due rows (FOR
// UPDATE SKIP LOCKED, with a lease so a replica that dies mid-send leaves
// them to another), POSTs each signed, and records the outcome: delivered,
// or a retry with exponential backoff, or dead after MaxAttempts failures
// (the dead-letter list of AlertService.ListAlertDeliveries).
//
// Delivery is at least once on the wire and exactly once for a receiver
// that drops repeated webhook-id values: the id is the delivery's, the
// same on every attempt (and across replicas).

// Delivery defaults.
const (
	// DefaultPollInterval is how often an idle Deliverer looks for due
	// deliveries: the delay of a first attempt after the alert is
	// recorded, at most.
	DefaultPollInterval = 500 * time.Millisecond
	// DefaultDeliveryBatch bounds the deliveries claimed (and sent
	// concurrently) at once per replica.
	DefaultDeliveryBatch = 16
	// DefaultAttemptTimeout bounds one POST, connection included.
	DefaultAttemptTimeout = 10 * time.Second
	// DefaultMaxAttempts failures make a delivery dead. With the default
	// backoff the last attempt is about 4.5 hours after the first.
	DefaultMaxAttempts = 12
	// DefaultBaseBackoff is the wait after the first failure; each
	// further failure doubles it, up to DefaultMaxBackoff.
	DefaultBaseBackoff = time.Second
	DefaultMaxBackoff  = time.Hour
)

// Signature headers (Standard Webhooks).
const (
	HeaderID        = "webhook-id"
	HeaderTimestamp = "webhook-timestamp"
	HeaderSignature = "webhook-signature"
	// SecretPrefix starts every signing secret; base64 of the key follows.
	SecretPrefix = "whsec_"
)

// DeliveryConfig configures a Deliverer; zero values take the defaults.
type DeliveryConfig struct {
	PollInterval   time.Duration
	Batch          int
	AttemptTimeout time.Duration
	MaxAttempts    int
	BaseBackoff    time.Duration
	MaxBackoff     time.Duration
	// Open decrypts a webhook's sealed secret (the key ring); nil fails
	// every delivery.
	Open func(ciphertext []byte) ([]byte, error)
	// Client sends the requests (default: one that follows no redirects).
	Client *http.Client
	Logger *slog.Logger
	// Now is the clock of signatures (default time.Now).
	Now func() time.Time
}

// DeliveryStats are a Deliverer's counters since start.
type DeliveryStats struct {
	Delivered, Failed, Dead uint64
}

// Deliverer sends pending alert deliveries.
type Deliverer struct {
	cfg                     DeliveryConfig
	st                      *store.Store
	delivered, failed, dead atomic.Uint64
}

// NewDeliverer returns a Deliverer over st.
func NewDeliverer(cfg DeliveryConfig, st *store.Store) *Deliverer {
	if cfg.PollInterval <= 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.Batch <= 0 {
		cfg.Batch = DefaultDeliveryBatch
	}
	if cfg.AttemptTimeout <= 0 {
		cfg.AttemptTimeout = DefaultAttemptTimeout
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = DefaultMaxAttempts
	}
	if cfg.BaseBackoff <= 0 {
		cfg.BaseBackoff = DefaultBaseBackoff
	}
	if cfg.MaxBackoff <= 0 {
		cfg.MaxBackoff = DefaultMaxBackoff
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Deliverer{cfg: cfg, st: st}
}

// Stats returns the counters.
func (d *Deliverer) Stats() DeliveryStats {
	return DeliveryStats{Delivered: d.delivered.Load(), Failed: d.failed.Load(), Dead: d.dead.Load()}
}

// lease is how long a claimed delivery stays away from other replicas:
// longer than one attempt, so only a dead replica's claims come back.
func (d *Deliverer) lease() time.Duration { return 2*d.cfg.AttemptTimeout + 5*time.Second }

// Run delivers until ctx is done, surviving Postgres outages (it retries
// at the poll interval).
func (d *Deliverer) Run(ctx context.Context) error {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		n, err := d.RunOnce(ctx)
		if err != nil && ctx.Err() == nil {
			d.cfg.Logger.Warn("alert delivery: claim failed", "error", err)
		}
		wait := d.cfg.PollInterval
		if n == d.cfg.Batch {
			wait = 0 // more may be due
		}
		t.Reset(wait)
	}
}

// RunOnce claims due deliveries and sends them, returning how many it
// claimed.
func (d *Deliverer) RunOnce(ctx context.Context) (int, error) {
	work, err := d.st.DeliveryClaim(ctx, d.cfg.Batch, d.lease())
	if err != nil {
		return 0, err
	}
	var wg sync.WaitGroup
	for _, w := range work {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.deliver(ctx, w)
		}()
	}
	wg.Wait()
	return len(work), nil
}

func (d *Deliverer) deliver(ctx context.Context, w store.DeliveryWork) {
	log := d.cfg.Logger.With("delivery_id", w.ID, "alert_id", w.Alert.AlertID, "org_id", w.Alert.OrgID)
	err := d.send(ctx, w)
	// Record with a context of its own: a shutdown mid-send still
	// records what happened when it can (else the lease retries it).
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err == nil {
		if rerr := d.st.DeliveryDone(rctx, w.ID); rerr != nil {
			log.Warn("alert delivery: sent, but recording it failed (it will be sent again)", "error", rerr)
			return
		}
		d.delivered.Add(1)
		return
	}
	attempts := w.Attempts + 1
	next := time.Now().Add(Backoff(attempts, d.cfg.BaseBackoff, d.cfg.MaxBackoff))
	msg := err.Error()
	if len(msg) > 500 {
		msg = msg[:500]
	}
	if rerr := d.st.DeliveryFailed(rctx, w.ID, msg, next, d.cfg.MaxAttempts); rerr != nil {
		log.Warn("alert delivery: recording a failed attempt failed", "error", rerr)
		return
	}
	d.failed.Add(1)
	if attempts >= d.cfg.MaxAttempts {
		d.dead.Add(1)
		log.Warn("alert delivery: dead after the last attempt", "attempts", attempts, "error", msg)
		return
	}
	log.Info("alert delivery: attempt failed, retrying", "attempts", attempts, "next_attempt_in_ms", time.Until(next).Milliseconds(), "error", msg)
}

// Backoff is the wait after the n-th failure (n ≥ 1): base·2^(n-1), at
// most maxWait, plus up to 10 % jitter so that deliveries failing
// together do not retry in lockstep.
func Backoff(n int, base, maxWait time.Duration) time.Duration {
	w := maxWait
	if n-1 < 40 {
		if b := base << (n - 1); b > 0 && b < maxWait {
			w = b
		}
	}
	return w + time.Duration(rand.Int64N(int64(w)/10+1))
}

// errStatus is a non-2xx answer.
type errStatus struct{ code int }

func (e errStatus) Error() string { return "HTTP " + strconv.Itoa(e.code) }

func (d *Deliverer) send(ctx context.Context, w store.DeliveryWork) error {
	if d.cfg.Open == nil {
		return errors.New("no key ring configured to open the webhook secret")
	}
	secret, err := d.cfg.Open(w.SecretCiphertext)
	if err != nil {
		return fmt.Errorf("open webhook secret: %w", err)
	}
	key, err := SecretKey(string(secret))
	if err != nil {
		return err
	}
	now := d.cfg.Now()
	// During a rotation's grace the previous secret signs too: the
	// receiver verifies with either (docs/alerts.md, "Rotating the secret").
	var prevKey []byte
	if w.PreviousValidUntil != nil && now.Before(*w.PreviousValidUntil) && len(w.PreviousSecretCiphertext) > 0 {
		prev, err := d.cfg.Open(w.PreviousSecretCiphertext)
		if err != nil {
			return fmt.Errorf("open previous webhook secret: %w", err)
		}
		if prevKey, err = SecretKey(string(prev)); err != nil {
			return err
		}
	}
	body, err := Payload(w.Alert)
	if err != nil {
		return err
	}
	ts := now.Unix()
	actx, cancel := context.WithTimeout(ctx, d.cfg.AttemptTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(actx, http.MethodPost, w.URL, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "sluice-alerts/1")
	req.Header.Set(HeaderID, w.ID)
	req.Header.Set(HeaderTimestamp, strconv.FormatInt(ts, 10))
	sig := Sign(key, w.ID, ts, body)
	if prevKey != nil {
		sig += " " + Sign(prevKey, w.ID, ts, body)
	}
	req.Header.Set(HeaderSignature, sig)
	resp, err := d.cfg.Client.Do(req)
	if err != nil {
		return fmt.Errorf("post: %w", err)
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return errStatus{resp.StatusCode}
	}
	return nil
}

// Sign returns the webhook-signature value of one message: "v1," and the
// base64 HMAC-SHA256, keyed by the secret's key, of "<id>.<timestamp>.<body>".
func Sign(key []byte, id string, ts int64, body []byte) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(id + "." + strconv.FormatInt(ts, 10) + "."))
	m.Write(body)
	return "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
}

// Verify checks a webhook-signature header (one or more space-separated
// "v1,<sig>" values) against the message; receivers do the same (and
// refuse timestamps far from their clock).
func Verify(secret, id, timestamp, signatures string, body []byte) error {
	key, err := SecretKey(secret)
	if err != nil {
		return err
	}
	ts, err := strconv.ParseInt(timestamp, 10, 64)
	if err != nil {
		return fmt.Errorf("bad %s %q", HeaderTimestamp, timestamp)
	}
	want := Sign(key, id, ts, body)
	for _, s := range strings.Fields(signatures) {
		if hmac.Equal([]byte(s), []byte(want)) {
			return nil
		}
	}
	return errors.New("no signature matches")
}

// SecretKey decodes a "whsec_<base64>" secret into its HMAC key.
func SecretKey(secret string) ([]byte, error) {
	b64, ok := strings.CutPrefix(secret, SecretPrefix)
	if !ok {
		return nil, errors.New("webhook secret does not start with " + SecretPrefix)
	}
	key, err := base64.StdEncoding.DecodeString(b64)
	if err != nil || len(key) == 0 {
		return nil, errors.New("webhook secret is not base64")
	}
	return key, nil
}

// Payload is the JSON body POSTed for an alert.
func Payload(a store.BudgetAlert) ([]byte, error) {
	typ := "budget.threshold"
	if a.ThresholdPercent == 0 {
		typ = "budget.soft_budget"
	}
	type data struct {
		AlertID          string  `json:"alert_id"`
		OrgID            string  `json:"org_id"`
		TeamID           string  `json:"team_id,omitempty"`
		ScopeKind        string  `json:"scope_kind"`
		ScopeID          string  `json:"scope_id"`
		ThresholdPercent int32   `json:"threshold_percent"`
		SpendUSD         float64 `json:"spend_usd"`
		CapUSD           float64 `json:"cap_usd"`
		SoftBudgetUSD    float64 `json:"soft_budget_usd"`
		BudgetDuration   string  `json:"budget_duration"`
		WindowStart      string  `json:"window_start"`
		Region           string  `json:"region,omitempty"`
		RequestID        string  `json:"request_id,omitempty"`
	}
	b, err := json.Marshal(struct {
		Type      string `json:"type"`
		Timestamp string `json:"timestamp"`
		Data      data   `json:"data"`
	}{typ, a.FiredAt.UTC().Format(time.RFC3339Nano), data{
		AlertID: a.AlertID, OrgID: a.OrgID, TeamID: a.TeamID, ScopeKind: a.ScopeKind, ScopeID: a.ScopeID,
		ThresholdPercent: a.ThresholdPercent, SpendUSD: float64(a.SpendMicros) / 1e6, CapUSD: float64(a.CapMicros) / 1e6,
		SoftBudgetUSD: float64(a.SoftMicros) / 1e6, BudgetDuration: a.Window, WindowStart: a.WindowStart.UTC().Format(time.RFC3339),
		Region: a.Region, RequestID: a.RequestID,
	}})
	if err != nil {
		return nil, fmt.Errorf("encode alert %s: %w", a.AlertID, err)
	}
	return b, nil
}
