package token

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"errors"
	"math/big"
	"strconv"
	"strings"
	"testing"
)

func TestGenerateCheck(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 200; i++ {
		tok := Generate(KeyPrefix)
		if err := Check(KeyPrefix, tok); err != nil {
			t.Fatalf("Check(%q) = %v", tok, err)
		}
		if seen[tok] {
			t.Fatalf("duplicate token %q", tok)
		}
		seen[tok] = true
		if got := len(tok); got != len(KeyPrefix)+bodyLen+checksumLen {
			t.Fatalf("len = %d", got)
		}
	}
}

func TestCheckRejectsTypos(t *testing.T) {
	tok := Generate(KeyPrefix)
	body := []byte(tok)
	// Change one body character: the checksum must catch it.
	i := len(KeyPrefix) + 5
	if body[i] == 'a' {
		body[i] = 'b'
	} else {
		body[i] = 'a'
	}
	if err := Check(KeyPrefix, string(body)); !errors.Is(err, ErrChecksum) {
		t.Fatalf("typo: err = %v, want ErrChecksum", err)
	}
	for _, bad := range []string{"", "sk-sluice-", tok[:len(tok)-1], tok + "x", strings.Replace(tok, "sk-sluice-", "sk-sluicx-", 1), tok[:20] + "!" + tok[21:]} {
		if err := Check(KeyPrefix, bad); !errors.Is(err, ErrMalformed) {
			t.Errorf("Check(%q) = %v, want ErrMalformed", bad, err)
		}
	}
	if err := Check(AdminPrefix, tok); !errors.Is(err, ErrMalformed) {
		t.Errorf("key token accepted as admin token: %v", err)
	}
}

func TestPeppers(t *testing.T) {
	secret1 := strings.Repeat("a", 32)
	secret2 := strings.Repeat("b", 40)
	p, err := ParsePeppers("1:" + secret1 + ", v2:" + secret2)
	if err != nil {
		t.Fatal(err)
	}
	if p.Current() != 2 {
		t.Fatalf("Current = %d, want 2", p.Current())
	}
	h1, _ := p.Hash(1, "x")
	h2, v := p.HashCurrent("x")
	if v != 2 || Equal(h1, h2) {
		t.Fatalf("hashes under different peppers must differ")
	}
	c := p.Candidates("x")
	if len(c) != 2 || c[0].Version != 2 || !Equal(c[1].Hash, h1) {
		t.Fatalf("Candidates = %+v", c)
	}
	if _, err := p.Hash(3, "x"); err == nil {
		t.Fatal("unknown version accepted")
	}
	_, err = ParsePeppers("1:short,x:" + secret1 + ",1:" + secret1 + ",1:" + secret2 + ",nocolon")
	if err == nil {
		t.Fatal("bad peppers accepted")
	}
	for _, want := range []string{"secret is 5 bytes", `version "x"`, "given twice", "want VERSION:SECRET"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
	if _, err := ParsePeppers(""); err == nil {
		t.Fatal("empty pepper accepted")
	}
}

func FuzzCheck(f *testing.F) {
	f.Add(Generate(KeyPrefix))
	f.Add("sk-sluice-")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		_ = Check(KeyPrefix, s) // must not panic
	})
}

func TestBase62UintAsBig(t *testing.T) {
	for _, n := range []uint64{0, 1, 61, 62, 63, 3843, 3844, 1<<32 - 1, 123456789} {
		if got, want := base62Uint(n, checksumLen), base62(new(big.Int).SetUint64(n), checksumLen); got != want {
			t.Fatalf("base62Uint(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestHashReusesStates(t *testing.T) {
	p, err := ParsePeppers("2:" + strings.Repeat("b", MinPepperLen) + ",1:" + strings.Repeat("a", MinPepperLen))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 { // a reused state hashes as a fresh one
		for _, v := range []int{1, 2} {
			secret := strings.Repeat(map[int]string{1: "a", 2: "b"}[v], MinPepperLen)
			m := hmac.New(sha256.New, []byte(secret))
			m.Write([]byte("tok" + strconv.Itoa(i)))
			got, err := p.Hash(v, "tok"+strconv.Itoa(i))
			if err != nil || !bytes.Equal(got, m.Sum(nil)) {
				t.Fatalf("Hash(%d, tok%d) = %x, %v", v, i, got, err)
			}
		}
	}
}

// BenchmarkCheckCandidates is a key's work on every authenticated
// request: the checksum check and its hash under each pepper.
func BenchmarkCheckCandidates(b *testing.B) {
	p, err := ParsePeppers("1:" + strings.Repeat("a", MinPepperLen))
	if err != nil {
		b.Fatal(err)
	}
	tok := Generate(KeyPrefix)
	b.ReportAllocs()
	for range b.N {
		if Check(KeyPrefix, tok) != nil || len(p.Candidates(tok)) != 1 {
			b.Fatal("bad token")
		}
	}
}
