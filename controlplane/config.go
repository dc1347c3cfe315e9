// Configuration of the control plane: the defaults (named constants),
// Config, and Validate, which reports every problem at once. cmd/sluice
// maps each flag of `sluice control` to a field (and its SLUICE_<FLAG>
// variable); a zero duration or size means the default, documented per
// field, never "off".

package controlplane

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sluicegw/sluice/controlplane/internal/admin"
	"github.com/sluicegw/sluice/controlplane/internal/auditexport"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
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
	// DefaultAdminMaxRequestBytes bounds one admin request body and its
	// decoded message (see admin.DefaultMaxRequestBytes).
	DefaultAdminMaxRequestBytes = admin.DefaultMaxRequestBytes
	// DefaultAdminReadTimeout bounds reading one admin request, headers
	// and body: a body that trickles in is cut off there (4 MiB in 30 s
	// needs ~140 KB/s).
	DefaultAdminReadTimeout = 30 * time.Second
	// DefaultAuditRetention is how long the SLUICE_AUDIT stream keeps
	// exported audit records.
	DefaultAuditRetention = auditexport.DefaultRetention
	// DefaultAdminReadHeaderTimeout bounds reading a request's headers.
	DefaultAdminReadHeaderTimeout = 10 * time.Second
	// DefaultAdminWriteTimeout bounds one admin answer from the end of its
	// headers; every admin RPC is a short unary call.
	DefaultAdminWriteTimeout = 2 * time.Minute
	// DefaultAdminIdleTimeout closes keep-alive connections idle this long.
	DefaultAdminIdleTimeout = 2 * time.Minute
	// DefaultDBConnectTimeout bounds one Postgres connection attempt when
	// the database URL sets no connect_timeout, so an unreachable database
	// answers Unavailable instead of hanging until the caller gives up.
	DefaultDBConnectTimeout = 5 * time.Second
)

// Fixed bounds of the admin listener.
const (
	// adminMaxHeaderBytes bounds a request's headers (a bearer token and
	// a few Connect headers need well under 8 KiB).
	adminMaxHeaderBytes = 64 << 10
	// adminMaxConcurrentStreams bounds the h2c streams of one connection.
	adminMaxConcurrentStreams = 100
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
	// AdminMaxRequestBytes bounds an admin request body
	// (DefaultAdminMaxRequestBytes if 0). A declared larger body is
	// refused before it is read, a longer one is cut off at the limit;
	// both answer ResourceExhausted.
	AdminMaxRequestBytes int
	// AdminReadTimeout bounds reading one admin request, headers and body
	// (DefaultAdminReadTimeout if 0).
	AdminReadTimeout time.Duration
	// AuditRetention is how long the SLUICE_AUDIT stream keeps audit
	// records (auditexport.DefaultRetention if 0): ship them to immutable
	// storage within it.
	AuditRetention time.Duration
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
	if c.AdminMaxRequestBytes < 0 {
		errs = append(errs, errors.New("admin max request bytes must not be negative"))
	}
	if c.AdminReadTimeout < 0 {
		errs = append(errs, errors.New("admin read timeout must not be negative"))
	}
	if c.AuditRetention < 0 {
		errs = append(errs, errors.New("audit retention (SLUICE_AUDIT_RETENTION) must not be negative"))
	}
	if c.Publish.Debounce < 0 {
		errs = append(errs, errors.New("publish debounce must not be negative"))
	}
	if c.Publish.MaxDelay < 0 {
		errs = append(errs, errors.New("publish max delay must not be negative"))
	}
	if c.Publish.TickInterval < 0 {
		errs = append(errs, errors.New("publish tick interval must not be negative"))
	}
	return errors.Join(errs...)
}

// setDefaults fills the zero values that mean "the default".
func (c *Config) setDefaults() {
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.AdminMaxRequestBytes == 0 {
		c.AdminMaxRequestBytes = DefaultAdminMaxRequestBytes
	}
	if c.AdminReadTimeout == 0 {
		c.AdminReadTimeout = DefaultAdminReadTimeout
	}
}

// redactErr drops the input from a connection-string parse error, which
// may contain a password.
func redactErr(err error) error {
	return errors.New(strings.SplitN(err.Error(), ":", 2)[0])
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
