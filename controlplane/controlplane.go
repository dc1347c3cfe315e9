// Package controlplane runs Sluice's control plane: the Postgres-backed
// owner of the tenancy hierarchy, virtual keys, admin tokens and audit
// trail, serving the Connect admin API (SPEC §2, §5).
//
// Config, New and Run are its whole exported surface; everything else is
// in internal packages.
package controlplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/sluicegw/sluice/controlplane/internal/admin"
	"github.com/sluicegw/sluice/controlplane/internal/alerts"
	"github.com/sluicegw/sluice/controlplane/internal/publish"
	"github.com/sluicegw/sluice/controlplane/internal/spend"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/sql/migrations"
)

// Defaults.
const (
	// DefaultAdminAddr is loopback only: exposing the admin API is a
	// deliberate act.
	DefaultAdminAddr = "127.0.0.1:8081"
	// DefaultNATSURL is the local NATS server.
	DefaultNATSURL = "nats://127.0.0.1:4222"
	// DefaultDatabaseURL is the local development database.
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/sluice?sslmode=disable"
	// DefaultShutdownTimeout bounds graceful shutdown.
	DefaultShutdownTimeout = 10 * time.Second
	// MinBootstrapTokenLen is the shortest accepted bootstrap token.
	MinBootstrapTokenLen = 32
)

// Config configures the control plane. Secrets come from the environment
// or files (see cmd/sluice), never from flags.
type Config struct {
	// DatabaseURL is the Postgres connection string.
	DatabaseURL string
	// AdminAddr is the admin API's listen address (HTTP/1.1 and h2c).
	AdminAddr string
	// NATSURL is the NATS server (JetStream enabled) config is
	// distributed through.
	NATSURL string
	// InstanceID names this replica (default: host name and pid).
	InstanceID string
	// Publish tunes config distribution (zero values: defaults).
	Publish PublishConfig
	// BootstrapToken is the platform-admin token for first setup
	// (SLUICE_ADMIN_TOKEN); empty disables it.
	BootstrapToken string
	// KeyPepper is the versioned HMAC pepper set for key and admin-token
	// hashes (SLUICE_KEY_PEPPER), "VERSION:SECRET[,VERSION:SECRET]".
	KeyPepper string
	// KEK is the key ring that seals upstream credentials of deployments
	// at rest (SLUICE_KEK), "VERSION:BASE64KEY[,VERSION:BASE64KEY]" with
	// 32-byte keys; new credentials use the highest version, every listed
	// version opens. Required: it is its own secret, never derived from
	// the admin token or the pepper, and data planes need the same ring.
	KEK string
	// Migrate applies pending migrations at start. Without it, New refuses
	// to start on an out-of-date schema.
	Migrate bool
	// ShutdownTimeout bounds graceful shutdown (DefaultShutdownTimeout if 0).
	ShutdownTimeout time.Duration
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Validate reports every problem of c at once.
func (c *Config) Validate() error {
	var errs []error
	if c.DatabaseURL == "" {
		errs = append(errs, errors.New("database URL is required (--database-url or SLUICE_DATABASE_URL)"))
	} else if _, err := pgxpool.ParseConfig(c.DatabaseURL); err != nil {
		errs = append(errs, fmt.Errorf("database URL does not parse: %w", redactErr(err)))
	}
	if c.AdminAddr == "" {
		errs = append(errs, errors.New("admin address is required (--addr)"))
	} else if _, _, err := net.SplitHostPort(c.AdminAddr); err != nil {
		errs = append(errs, fmt.Errorf("admin address %q: %w", c.AdminAddr, err))
	}
	if c.NATSURL == "" {
		errs = append(errs, errors.New("NATS URL is required (--nats-url or SLUICE_NATS_URL)"))
	}
	if c.BootstrapToken != "" && len(c.BootstrapToken) < MinBootstrapTokenLen {
		errs = append(errs, fmt.Errorf("bootstrap admin token (SLUICE_ADMIN_TOKEN) is %d characters; want at least %d", len(c.BootstrapToken), MinBootstrapTokenLen))
	}
	if strings.TrimSpace(c.KeyPepper) == "" {
		errs = append(errs, errors.New("key pepper is required (SLUICE_KEY_PEPPER or SLUICE_KEY_PEPPER_FILE)"))
	} else if _, err := token.ParsePeppers(c.KeyPepper); err != nil {
		errs = append(errs, fmt.Errorf("key pepper: %w", err))
	}
	if strings.TrimSpace(c.KEK) == "" {
		errs = append(errs, errors.New("key ring is required (SLUICE_KEK or SLUICE_KEK_FILE): VERSION:BASE64KEY with a 32-byte key, e.g. 1:$(openssl rand -base64 32)"))
	} else if _, err := keyring.Parse(c.KEK); err != nil {
		errs = append(errs, fmt.Errorf("key ring (SLUICE_KEK): %w", err))
	}
	if c.ShutdownTimeout < 0 {
		errs = append(errs, errors.New("shutdown timeout must not be negative"))
	}
	return errors.Join(errs...)
}

// redactErr drops the input from a connection-string parse error, which
// may contain a password.
func redactErr(err error) error {
	return errors.New(strings.SplitN(err.Error(), ":", 2)[0])
}

// ControlPlane is a configured, not yet running control plane.
type ControlPlane struct {
	cfg    Config
	log    *slog.Logger
	pool   *pgxpool.Pool
	ln     net.Listener
	srv    *http.Server
	store  *store.Store
	nc     *nats.Conn
	pub    *publish.Publisher
	spend  *spend.Consumer
	alerts *alerts.Consumer
}

// PublishConfig tunes config distribution; zero values take the defaults
// of the publish package.
type PublishConfig struct {
	// Debounce delays snapshot compilation after a change (default 150ms).
	Debounce time.Duration
	// MaxDelay bounds how long a stream of changes can postpone a
	// snapshot (default 2s).
	MaxDelay time.Duration
	// TickInterval is the liveness tick period (default 1s).
	TickInterval time.Duration
}

// New connects to Postgres, checks (or applies, with Migrate) the schema
// and binds the admin listener.
func New(ctx context.Context, cfg Config) (*ControlPlane, error) {
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	peppers, _ := token.ParsePeppers(cfg.KeyPepper)
	ring, _ := keyring.Parse(cfg.KEK)
	pool, err := pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("connect postgres: %w", redactErr(err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect postgres: %w", err)
	}
	if cfg.Migrate {
		applied, err := migrations.Apply(ctx, pool)
		if err != nil {
			pool.Close()
			return nil, err
		}
		if len(applied) > 0 {
			log.Info("applied migrations", "versions", applied)
		}
	} else if err := migrations.CheckCurrent(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	if cfg.InstanceID == "" {
		host, _ := os.Hostname()
		cfg.InstanceID = fmt.Sprintf("%s-%d", host, os.Getpid())
	}
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("sluice-control "+cfg.InstanceID), nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond), nats.RetryOnFailedConnect(true))
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	st := store.New(pool, cfg.Now)
	pub, err := publish.New(publish.Config{
		InstanceID: cfg.InstanceID, Debounce: cfg.Publish.Debounce, MaxDelay: cfg.Publish.MaxDelay, TickInterval: cfg.Publish.TickInterval, Logger: log,
		OnHeartbeat: func(ctx context.Context, hb *configv1.Heartbeat) error {
			return st.DataPlaneUpsert(ctx, dataPlaneFrom(hb))
		},
	}, st, pool, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// Every replica consumes usage events; JetStream spreads the batches
	// and recording is idempotent (see package spend).
	spendConsumer, err := spend.New(spend.Config{Logger: log}, st, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	// Budget alerts the same way (see package alerts).
	alertConsumer, err := alerts.New(alerts.Config{Logger: log}, st, nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.AdminAddr)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, fmt.Errorf("listen on %s: %w", cfg.AdminAddr, err)
	}
	mets := newMetrics(pool, pub, spendConsumer, alertConsumer)
	mux := http.NewServeMux()
	mux.Handle("/", admin.NewHandler(admin.Options{Store: st, Peppers: peppers, BootstrapToken: cfg.BootstrapToken,
		KeyRing: ring, Logger: log, Observe: mets.observe}))
	mux.Handle("GET /metrics", mets.handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := pool.Ping(ctx); err != nil {
			http.Error(w, "postgres unreachable", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:           mux,
		Protocols:         protocols,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	if cfg.BootstrapToken == "" {
		log.Warn("no bootstrap admin token configured (SLUICE_ADMIN_TOKEN); only admin tokens from the database are accepted")
	}
	return &ControlPlane{cfg: cfg, log: log, pool: pool, ln: ln, srv: srv, store: st, nc: nc, pub: pub, spend: spendConsumer,
		alerts: alertConsumer}, nil
}

// Addr returns the admin API's bound address.
func (c *ControlPlane) Addr() string { return c.ln.Addr().String() }

// Run serves until ctx is done, then shuts down gracefully and releases
// the database pool.
func (c *ControlPlane) Run(ctx context.Context) error {
	defer c.pool.Close()
	defer c.nc.Close()
	pctx, stopPub := context.WithCancel(ctx)
	pubDone := make(chan struct{})
	go func() { defer close(pubDone); _ = c.pub.Run(pctx) }()
	defer func() { stopPub(); <-pubDone }()
	spendDone := make(chan struct{})
	go func() { defer close(spendDone); _ = c.spend.Run(pctx) }()
	defer func() { stopPub(); <-spendDone }()
	alertsDone := make(chan struct{})
	go func() { defer close(alertsDone); _ = c.alerts.Run(pctx) }()
	defer func() { stopPub(); <-alertsDone }()
	errc := make(chan error, 1)
	go func() { errc <- c.srv.Serve(c.ln) }()
	c.log.Info("control plane serving", "admin_addr", c.Addr(), "pid", os.Getpid())
	select {
	case err := <-errc:
		return fmt.Errorf("admin server: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.ShutdownTimeout)
	defer cancel()
	if err := c.srv.Shutdown(sctx); err != nil {
		return fmt.Errorf("shutdown admin server: %w", err)
	}
	c.log.Info("control plane stopped")
	return nil
}

// dataPlaneFrom converts a heartbeat to the fleet row.
func dataPlaneFrom(hb *configv1.Heartbeat) store.DataPlane {
	d := store.DataPlane{
		InstanceID: hb.GetInstanceId(), Region: hb.GetRegion(), AppliedVersion: hb.GetAppliedVersion(),
		EventsSeq: hb.GetEventsSeq(), RegionSeq: hb.GetRegionSeq(), Health: hb.GetHealth(), InFlight: hb.GetInFlight(),
		StalenessSeconds: hb.GetStalenessSeconds(),
	}
	for _, r := range hb.GetRejected() {
		d.Rejected = append(d.Rejected, store.RejectedSnapshot{Version: r.GetVersion(), Reason: r.GetReason(), Time: r.GetAt().AsTime()})
	}
	return d
}
