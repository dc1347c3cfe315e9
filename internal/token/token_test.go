package token

import (
	"errors"
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
