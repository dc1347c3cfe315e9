// Package oidctest runs a local OIDC issuer for tests: discovery and a
// JWKS served over HTTP on loopback, signing keys that rotate, and an
// outage switch.
package oidctest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/hmac"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// Issuer is a test OIDC issuer. Its URL is the "iss" of its tokens.
type Issuer struct {
	t   testing.TB
	srv *httptest.Server
	// Fetches counts JWKS requests.
	Fetches atomic.Int64
	down    atomic.Bool

	mu        sync.Mutex
	published []jose.JSONWebKey // public keys served
	signer    *signingKey       // current
	n         int
}

type signingKey struct {
	kid  string
	priv any
	alg  jose.SignatureAlgorithm
}

// Start starts an issuer with one RSA signing key.
func Start(t testing.TB) *Issuer {
	t.Helper()
	is := &Issuer{t: t}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /.well-known/openid-configuration", func(w http.ResponseWriter, r *http.Request) {
		if is.down.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]string{"issuer": is.URL(), "jwks_uri": is.URL() + "/jwks"})
	})
	mux.HandleFunc("GET /jwks", func(w http.ResponseWriter, r *http.Request) {
		is.Fetches.Add(1)
		if is.down.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		is.mu.Lock()
		set := jose.JSONWebKeySet{Keys: append([]jose.JSONWebKey(nil), is.published...)}
		is.mu.Unlock()
		_ = json.NewEncoder(w).Encode(set)
	})
	is.srv = httptest.NewServer(mux)
	t.Cleanup(is.srv.Close)
	is.Rotate(false)
	return is
}

// URL is the issuer URL.
func (is *Issuer) URL() string { return is.srv.URL }

// JWKSURL is where its keys are served.
func (is *Issuer) JWKSURL() string { return is.srv.URL + "/jwks" }

// SetDown makes discovery and the JWKS answer 503 (or serve again).
func (is *Issuer) SetDown(down bool) { is.down.Store(down) }

// Rotate makes a new RSA key the signing key and publishes it; keepOld
// keeps the previous keys published, else they are withdrawn. It returns
// the new kid.
func (is *Issuer) Rotate(keepOld bool) string {
	is.t.Helper()
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		is.t.Fatal(err)
	}
	return is.add(priv, jose.RS256, keepOld)
}

// PrepareRotation generates an RSA key now and returns the function
// that makes it the signing key (as Rotate), for tests where key
// generation must not take time out of a measured window.
func (is *Issuer) PrepareRotation() func(keepOld bool) string {
	is.t.Helper()
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		is.t.Fatal(err)
	}
	return func(keepOld bool) string { return is.add(priv, jose.RS256, keepOld) }
}

// RotateEC is Rotate with an ES256 key (published without "alg": its
// algorithm comes from its curve).
func (is *Issuer) RotateEC(keepOld bool) string {
	is.t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		is.t.Fatal(err)
	}
	return is.add(priv, jose.ES256, keepOld)
}

func (is *Issuer) add(priv any, alg jose.SignatureAlgorithm, keepOld bool) string {
	is.mu.Lock()
	defer is.mu.Unlock()
	is.n++
	kid := fmt.Sprintf("k%d", is.n)
	var pub any
	jwkAlg := string(alg)
	switch p := priv.(type) {
	case *rsa.PrivateKey:
		pub = &p.PublicKey
	case *ecdsa.PrivateKey:
		pub, jwkAlg = &p.PublicKey, ""
	}
	k := jose.JSONWebKey{Key: pub, KeyID: kid, Algorithm: jwkAlg, Use: "sig"}
	if keepOld {
		is.published = append(is.published, k)
	} else {
		is.published = []jose.JSONWebKey{k}
	}
	is.signer = &signingKey{kid: kid, priv: priv, alg: alg}
	return kid
}

// NewUnpublishedKey returns a signing key the issuer never publishes
// (a token signed with it has an unknown kid).
func (is *Issuer) NewUnpublishedKey() (kid string, priv *rsa.PrivateKey) {
	is.t.Helper()
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		is.t.Fatal(err)
	}
	return "unpublished", priv
}

// Claims are the claims of a test token: the standard ones plus any
// extra (nested maps for dot paths).
type Claims struct {
	Subject, Audience string
	Expiry, NotBefore time.Time // zero Expiry: an hour from now; zero NotBefore: none
	NoExpiry          bool
	Extra             map[string]any
}

func (is *Issuer) std(c Claims) jwt.Claims {
	exp := c.Expiry
	if exp.IsZero() {
		exp = time.Now().Add(time.Hour)
	}
	out := jwt.Claims{Issuer: is.URL(), Subject: c.Subject, Audience: jwt.Audience{c.Audience}, IssuedAt: jwt.NewNumericDate(time.Now().Add(-time.Minute))}
	if !c.NoExpiry {
		out.Expiry = jwt.NewNumericDate(exp)
	}
	if !c.NotBefore.IsZero() {
		out.NotBefore = jwt.NewNumericDate(c.NotBefore)
	}
	return out
}

// Sign returns a token signed with the current key.
func (is *Issuer) Sign(c Claims) string {
	is.mu.Lock()
	s := is.signer
	is.mu.Unlock()
	return is.SignWith(s.kid, s.alg, s.priv, c)
}

// SignWith returns a token signed with priv under kid and alg.
func (is *Issuer) SignWith(kid string, alg jose.SignatureAlgorithm, priv any, c Claims) string {
	is.t.Helper()
	sig, err := jose.NewSigner(jose.SigningKey{Algorithm: alg, Key: priv},
		(&jose.SignerOptions{}).WithType("JWT").WithHeader(jose.HeaderKey("kid"), kid))
	if err != nil {
		is.t.Fatal(err)
	}
	b := jwt.Signed(sig).Claims(is.std(c))
	if c.Extra != nil {
		b = b.Claims(c.Extra)
	}
	tok, err := b.Serialize()
	if err != nil {
		is.t.Fatal(err)
	}
	return tok
}

// Unsigned returns an "alg: none" token for the current kid.
func (is *Issuer) Unsigned(c Claims) string {
	is.mu.Lock()
	kid := is.signer.kid
	is.mu.Unlock()
	return is.handMade(map[string]any{"alg": "none", "typ": "JWT", "kid": kid}, c, func([]byte) []byte { return nil })
}

// HS256WithPublicKey returns the classic forgery: an HS256 token whose
// HMAC secret is the current key's published public key (its JWK JSON).
func (is *Issuer) HS256WithPublicKey(c Claims) string {
	is.mu.Lock()
	kid := is.signer.kid
	pub := is.published[len(is.published)-1]
	is.mu.Unlock()
	secret, err := pub.MarshalJSON()
	if err != nil {
		is.t.Fatal(err)
	}
	return is.handMade(map[string]any{"alg": "HS256", "typ": "JWT", "kid": kid}, c, func(in []byte) []byte {
		m := hmac.New(sha256.New, secret)
		m.Write(in)
		return m.Sum(nil)
	})
}

func (is *Issuer) handMade(hdr map[string]any, c Claims, sign func([]byte) []byte) string {
	is.t.Helper()
	claims := map[string]any{}
	std, _ := json.Marshal(is.std(c))
	_ = json.Unmarshal(std, &claims)
	for k, v := range c.Extra {
		claims[k] = v
	}
	h, _ := json.Marshal(hdr)
	p, _ := json.Marshal(claims)
	in := base64.RawURLEncoding.EncodeToString(h) + "." + base64.RawURLEncoding.EncodeToString(p)
	return in + "." + base64.RawURLEncoding.EncodeToString(sign([]byte(in)))
}
