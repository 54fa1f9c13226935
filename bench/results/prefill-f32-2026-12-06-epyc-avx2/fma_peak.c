#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
int main(){
  const long N=600000000;
  #define DF(i) __m256 a##i=_mm256_set1_ps(i*1e-9f);
  R12(DF)
  __m256 x=_mm256_set1_ps(1.0000001f), y=_mm256_set1_ps(0.9999999f);
  double t=now();
  for(long n=0;n<N/12;n++){
    #define F(i) a##i=_mm256_fmadd_ps(a##i,x,y);
    R12(F)
  }
  double dt=now()-t;
  #define S(i) +a##i[0]
  float s=0 R12(S);
  printf("fma: %.3f ns per instr, %.1f GFLOP/s per core (%g)\n", dt/N*1e9, N*16/dt/1e9, s);
  #define DI(i) __m256i b##i=_mm256_set1_epi32(i);
  R12(DI)
  __m256i p=_mm256_set1_epi16(3), q=_mm256_set1_epi16(5);
  t=now();
  for(long n=0;n<N/12;n++){
    #define M(i) b##i=_mm256_add_epi32(b##i,_mm256_madd_epi16(p,q##i));
    __m256i q0=q,q1=_mm256_add_epi16(q,p),q2=q,q3=q1,q4=q,q5=q1,q6=q,q7=q1,q8=q,q9=q1,q10=q,q11=q1;
    R12(M)
    q=_mm256_add_epi16(q,p);
  }
  dt=now()-t;
  #define SI(i) +_mm256_extract_epi32(b##i,0)
  long s2=0 R12(SI);
  printf("madd+add: %.3f ns per pair, %.1f GMAC/s per core (%ld)\n", dt/N*1e9, N*16/dt/1e9, s2);
}
